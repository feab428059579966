"""FP8Layer and FP8Linear: linear layers whose three GEMMs run in FP8.

A training forward of an FP8 layer dispatches: [the lazy close of its scaling step, without an engine], the cast of
x, the cast of W (each one `lightning_fp8::scaled_cast` op that reads and updates the scaling state on the device),
and the forward GEMM inside the one autograd function (lightning_fp8/modules/linear_gemms.py), whose backward casts the
gradient, re-casts W with the forward's scale and runs the two gradient GEMMs. No host synchronisation, no Python
state changed per call, so `torch.compile` traces a converted model as one graph.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from lightning_fp8 import kernels
from lightning_fp8.modules.autocast import current_state
from lightning_fp8.modules.cast import caster_for
from lightning_fp8.modules.layer_state import FP8LayerState, report_restarted_scaling
from lightning_fp8.modules.linear_gemms import GemmConfig, linear_gemms
from lightning_fp8.modules.operand import FP8Matrix, FP8Operand
from lightning_fp8.modules.gathered_fp8 import (
    GatheredFP8Input,
    GatheredFP8Weight,
    observed_weight,
    resolve_gathered,
)
from lightning_fp8.modules.local_shards import is_dtensor, parallel_forward, refuse_gathered_input
from lightning_fp8.numerics.quantize import tensor_amax
from lightning_fp8.recipe import PER_TENSOR_SCALINGS, FP8Recipe
from lightning_fp8.renamed import warn_renamed


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if device_type == "meta":  # shape-only runs (the CUDA contract suite): meta has no autocast state
        return x.dtype
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _recomputing() -> bool:
    """True while a forward runs inside a backward pass: activation checkpointing recomputing it. Such a forward
    must cast exactly as the original one did, so it must not close the scaling step. (Under torch.compile the
    recomputation is part of the compiled backward and never re-enters this Python code.)"""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class FP8Layer(nn.Module):
    """What every FP8 layer shares, whatever linear-like class it extends: the FP8 metadata (`fp8_meta`), the
    precision switch, the scale update and the forward that runs the three GEMMs in FP8.

    A concrete FP8 layer is `FP8Layer` mixed into a linear-like module class that has `weight`, `bias`,
    `in_features` and `out_features` (FP8Linear: `class FP8Linear(FP8Layer, nn.Linear)`). It tells the FP8 path how
    its weight maps onto y = x W^T + b through `fp8_weight()` (for nn.Linear the weight itself, (out, in)).

    The FP8 metadata is not part of the layer's `state_dict` (a plain model loads the weights of a converted one,
    and exports such as `save_pretrained` keep the keys of the original model): `lightning_fp8.fp8_state_dict` and
    `load_fp8_state_dict` carry it, and every adapter's checkpoint includes it. A state_dict that does contain
    `fp8_meta.*` entries (an older checkpoint's) loads them too.
    """

    in_features: int
    out_features: int
    #: the FP8Recipe scalings this layer has a path for; None: every one the recipe accepts. Conversion keeps a layer
    #: whose recipe asks for another in BF16 with that reason, and FP8LayerFallback does not escalate it there.
    fp8_scalings: Optional[Tuple[str, ...]] = None
    #: the FP8Recipe.weight_grad choices this layer has a path for; None: every one (same rules as fp8_scalings)
    fp8_weight_grads: Optional[Tuple[str, ...]] = None

    def _init_fp8(self, recipe: Optional[FP8Recipe], device) -> None:
        self.fp8_meta = FP8LayerState(recipe if recipe is not None else FP8Recipe(), device=device)
        self._fp8_enabled = True
        #: why the layer is not in FP8 (None while it is); set by fallback logic
        self.fp8_disabled_reason: Optional[str] = None
        #: why the layer's scaling was made finer than its conversion recipe's (None while it was not); set by
        #: FP8LayerFallback's escalation, shown in the precision map
        self.fp8_escalation_reason: Optional[str] = None
        #: False when an engine syncs and updates the scales (once per optimizer step, after an amax all-reduce)
        self.closes_own_steps = True
        #: keep the forward's FP8 W^T for the backward where the cast writes it (per-tensor recipes on CUDA): one
        #: launch less per step for 1 byte per weight element held. The engine sets it False under FSDP2, whose
        #: gathered weights are freed after the forward (keeping W^T would hold a whole unsharded weight per layer)
        self.keep_weight_transpose = True
        #: optional callable(role, tensor) called with each high-precision operand before its cast (observability
        #: samples statistics through it); None costs nothing
        self.fp8_observer = None
        self.register_load_state_dict_post_hook(_sync_enabled_flag_after_load)
        self._register_state_dict_hook(_drop_fp8_meta_from_state_dict)

    def fp8_weight(self) -> torch.Tensor:
        """The weight as the (out_features, in_features) matrix of y = x W^T + b (a view, never a copy)."""
        return self.weight

    # -- precision switch ---------------------------------------------------------------------------------------
    @property
    def fp8_enabled(self) -> bool:
        return self._fp8_enabled

    @fp8_enabled.setter
    def fp8_enabled(self, value: bool) -> None:
        self._fp8_enabled = bool(value)
        self.fp8_meta.enabled.fill_(bool(value))
        if value:
            self.fp8_disabled_reason = None

    @property
    def recipe(self) -> FP8Recipe:
        """The layer's effective recipe (per-layer recipes and fallback's escalation change it)."""
        return self.fp8_meta.recipe

    @recipe.setter
    def recipe(self, recipe: FP8Recipe) -> None:
        if not isinstance(recipe, FP8Recipe):
            raise TypeError(f"recipe must be an FP8Recipe, got {type(recipe).__name__}")
        self.fp8_meta.set_recipe(recipe)

    # -- scaling ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def close_scaling_step(self, taken: bool = True) -> None:
        """Close this layer's scaling step for all three roles (numerics.scaling.close_step): count its overflows
        and clips, and move a taken step's amaxes into the history. An engine does this for every layer at once
        after each optimizer step; a layer trained without one does it lazily at its next training forward."""
        meta = self.fp8_meta
        torch.ops.lightning_fp8.close_scaling_step(
            meta.amax_history, meta.overflow_count, meta.clip_count, *meta.constants(), taken
        )

    def update_scales(self, taken: bool = True) -> None:
        """Deprecated name of `close_scaling_step` (removed in 0.3)."""
        warn_renamed("FP8Layer.update_scales()", "FP8Layer.close_scaling_step()")
        self.close_scaling_step(taken)

    @property
    def autoupdate_scales(self) -> bool:
        """Deprecated name of `closes_own_steps` (removed in 0.3)."""
        warn_renamed("FP8Layer.autoupdate_scales", "FP8Layer.closes_own_steps")
        return self.closes_own_steps

    @autoupdate_scales.setter
    def autoupdate_scales(self, value: bool) -> None:
        warn_renamed("FP8Layer.autoupdate_scales", "FP8Layer.closes_own_steps")
        self.closes_own_steps = value

    def close_pending_step(self) -> None:
        """What a training forward does first when no engine closes the steps: close the step the previous
        iteration recorded (a no-op when nothing was recorded since the last close, in evaluation, and in an
        activation-checkpointing recompute, which must cast as its original forward did). Whatever casts this
        layer's weight before its forward (FSDP2's FP8 all-gather) calls it first, or it would cast with the
        history of the step before."""
        if self.training and self.closes_own_steps and not _recomputing():
            self.close_scaling_step()

    # -- forward ------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.fp8_weight()
        if is_dtensor(weight):  # tensor parallelism: the FP8 forward on the local shards (modules/local_shards.py)
            return parallel_forward(self, x, weight, self.bias, self._forward_on)
        refuse_gathered_input(x, self, "is not tensor-parallel")
        return self._forward_on(x, weight, self.bias)

    def _forward_on(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], *extra) -> torch.Tensor:
        """The forward with these operands (the layer's own, or its local shards under tensor parallelism); `extra`
        goes on to `high_precision_forward` and `fp8_forward` (an experts layer's group offsets)."""
        autocast_state = current_state()
        recipe = autocast_state.recipe or self.recipe
        # an operand cast before this forward (a weight FSDP2 all-gathered in FP8, an input sequence parallelism
        # all-gathered in FP8) stays FP8 only where this forward computes with that very cast
        fp8 = self._fp8_enabled and autocast_state.enabled and not autocast_state.calibrating
        weight = resolve_gathered(weight, recipe, self.training, fp8)
        x = resolve_gathered(x, recipe, self.training, fp8)
        if autocast_state.calibrating:
            self._record_calibration(x, weight)
            return self.high_precision_forward(x, weight, bias, *extra)
        if not (self._fp8_enabled and autocast_state.enabled):
            return self.high_precision_forward(x, weight, bias, *extra)
        # training mode records amaxes and uses the recipe's scaling; eval mode casts with current scaling and leaves
        # the state alone. (Grad mode does not decide: reentrant activation checkpointing runs the training forward
        # under no_grad, and it must cast exactly as its recomputation will.)
        training = self.training
        if (training and self.fp8_meta.restarted_as is not None and not x.is_meta
                and not torch.compiler.is_compiling()):  # (a meta-device trace of the forward computes nothing)
            report_restarted_scaling()  # weights loaded without this layer's FP8 state: say so, once
        self.close_pending_step()
        observer = None if torch.compiler.is_compiling() else self.fp8_observer
        return self.fp8_forward(x, weight, bias, recipe, training, observer, *extra)

    def high_precision_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The layer's own computation without FP8 (BF16 under autocast): what fallback, calibration and
        `fp8_autocast(enabled=False)` run. A linear: F.linear; another FP8 layer class overrides it. `weight` and
        `bias` are the layer's own, or their local shards under tensor parallelism."""
        return F.linear(x, weight, bias)

    def fp8_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], recipe: FP8Recipe,
                    training: bool, observer) -> torch.Tensor:
        """The casts and the three FP8 GEMMs of y = x W^T + b: `weight` is `fp8_weight()` and `bias` the layer's, or
        their local shards under tensor parallelism; training=True records amaxes and uses the recipe's scaling. Another
        FP8 layer class (a convolution) overrides it with its own GEMMs; the switch, calibration, scale close and
        observer above stay shared."""
        if observer is not None:
            observer("input", observed_weight(x))
            observer("weight", observed_weight(weight))
        meta = self.fp8_meta
        x2d = x.reshape(-1, weight.shape[1])
        caster = caster_for(recipe)
        quantized_wgrad = torch.is_grad_enabled() and weight.requires_grad and not recipe.high_precision_wgrad
        pad_to = caster.token_padding(x2d, quantized_wgrad)
        if isinstance(x2d, GatheredFP8Input):  # sequence parallelism gathered it in FP8
            x_fp8, _, x_scale_inv = x2d.fp8_operands(meta, training)
            x_t = FP8Matrix(x_fp8.t().contiguous(), x_scale_inv) if quantized_wgrad and kernels.materializes_transpose(
                x2d) else None  # the layout the weight-gradient GEMM reads
            x_cast = FP8Operand(FP8Matrix(x_fp8, x_scale_inv), x_t)
            pad_to = 1
        else:
            x_cast = caster.cast(x2d, meta.amax_history, "input", training, layouts=(True, quantized_wgrad),
                                 pad_to=pad_to, history_sized=meta.input.history_sized)
        if isinstance(weight, GatheredFP8Weight):  # FSDP2 gathered it in FP8
            w_fp8, w_scale, w_scale_inv = weight.fp8_operands(meta, training)
            w_cast = FP8Operand(FP8Matrix(w_fp8, w_scale_inv), None, w_scale)
        else:
            # W^T for the input-gradient GEMM from the same pass, kept for backward, where the cast writes it in that
            # pass (per-tensor on CUDA, microscaled everywhere)
            keep_w_t = (self.keep_weight_transpose and (recipe.microscaled or not recipe.fine_grained)
                        and x2d.requires_grad and torch.is_grad_enabled())
            w_cast = caster.cast(weight, meta.amax_history, "weight", training, layouts=(True, keep_w_t),
                                 history_sized=meta.weight.history_sized)
        cfg = GemmConfig(recipe, _output_dtype(x), training, pad_to, training and meta.grad_output.history_sized)
        out = linear_gemms(x2d, weight, bias, x_cast, w_cast, meta.amax_history, observer, cfg)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @torch.no_grad()
    def _record_calibration(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        # nothing is cast while calibrating: only the amaxes are observed (no clip or overflow is counted)
        self.fp8_meta.input.observe_amax(tensor_amax(x))
        self.fp8_meta.weight.observe_amax(tensor_amax(weight))

    def to_unconverted(self) -> nn.Module:
        """The original (high-precision) layer with the same Parameters: what `revert_fp8` puts back."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to revert itself")

    def reset_fp8_state(self) -> None:
        """Forget every role's amax history (e.g. before retrying FP8 after a fallback: old scales may be stale);
        the next training step starts with current scaling."""
        self.fp8_meta.reset()

    def sync_precision_flag(self) -> None:
        """Re-read the precision switch from its buffer after the buffer was written in place (a rollback, a load).
        A state still on the meta device has no value to read: the switch stays as it is."""
        if not self.fp8_meta.is_meta:
            self._fp8_enabled = bool(self.fp8_meta.enabled)

    def extra_repr(self) -> str:
        precision = "fp8" if self._fp8_enabled else f"bf16 ({self.fp8_disabled_reason or 'disabled'})"
        scaling = self.recipe.scaling
        if scaling == "blockwise":
            scaling += f"({self.recipe.block_size})"
        wgrad = ", weight_grad=high_precision" if self.recipe.high_precision_wgrad else ""
        return f"{super().extra_repr()}, format={self.recipe.format}, scaling={scaling}{wgrad}, precision={precision}"


class FP8Linear(FP8Layer, nn.Linear):
    """nn.Linear whose GEMMs run in FP8 (see the module docstring for the recipe per GEMM).

    It keeps nn.Linear's `weight` and `bias` Parameters and state_dict keys; the FP8 metadata lives in `fp8_meta`
    (outside the state_dict: see FP8Layer).

    `fp8_enabled = False` makes the layer compute like nn.Linear in the compute dtype (BF16 under autocast), with no
    FP8 cast: this is the switch per-layer fallback uses.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        recipe: Optional[FP8Recipe] = None,
    ) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(recipe, device=self.weight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Optional[FP8Recipe] = None) -> "FP8Linear":
        """Wrap an existing linear, reusing its Parameters (optimizer references and weight tying survive)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features = linear.in_features
        new.out_features = linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        new._init_fp8(recipe, device=linear.weight.device)
        return new

    def to_unconverted(self) -> nn.Linear:
        return linear_shell(self.in_features, self.out_features, self.weight, self.bias, self.training)


def linear_shell(in_features: int, out_features: int, weight: nn.Parameter, bias: Optional[nn.Parameter],
                 training: bool) -> nn.Linear:
    """torch's nn.Linear over these Parameters (nothing allocated, nothing initialised): a converted layer given back
    its class, or a provisional one standing for a plain layer."""
    linear = nn.Linear.__new__(_TORCH_LINEAR)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = in_features, out_features
    linear.weight = weight
    linear.bias = bias
    linear.train(training)
    return linear


#: torch's class, whatever `torch.nn.Linear` names at a call (integrations/linear_builder.py replaces it for a while)
_TORCH_LINEAR = nn.Linear


def casts_input_per_tensor(layer: nn.Module) -> bool:
    """Whether `layer` is an FP8 layer computing in FP8 whose own recipe casts its input with one scale per tensor:
    what tensor-parallel FP8 communication can carry (one scale per rank's bytes). A BF16 fallback casts nothing and a
    fine-grained recipe (rowwise, blockwise) one scale per tile, so their styles communicate in high precision. (At
    run time lightning_fp8/distributed/tensor_parallel.py's fp8_input_cast also reads fp8_autocast's state.)"""
    return (isinstance(layer, FP8Layer) and layer.fp8_enabled
            and layer.recipe.scaling in PER_TENSOR_SCALINGS)


def _sync_enabled_flag_after_load(module: FP8Layer, incompatible_keys) -> None:
    """After a load: a layer built on the meta device whose weight the load put on a real device (`assign=True`)
    gets a fresh FP8 state there (the load brought none: see FP8Layer), then the switch is read from its buffer."""
    weight = module.fp8_weight()
    if module.fp8_meta.is_meta and not weight.is_meta:
        module.fp8_meta.materialize(weight.device)
    module.sync_precision_flag()


def _drop_fp8_meta_from_state_dict(module: FP8Layer, state_dict, prefix: str, local_metadata) -> None:
    """The layer's state_dict holds what the original layer's did (see FP8Layer): drop the FP8 metadata entries."""
    for key in [k for k in state_dict if k.startswith(prefix + "fp8_meta.")]:
        del state_dict[key]
