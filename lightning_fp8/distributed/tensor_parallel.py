"""Tensor-parallel styles for FP8 layers: drop-ins for torch's in a `parallelize_module` plan.

    from lightning_fp8.distributed import FP8ColwiseParallel, FP8RowwiseParallel, PrepareFP8ModuleInput

    parallelize_module(block, tp_mesh, {
        "attention_norm": SequenceParallel(),
        "attention": PrepareFP8ModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "attention.wq": FP8ColwiseParallel(), "attention.wk": FP8ColwiseParallel(), "attention.wv": FP8ColwiseParallel(),
        "attention.wo": FP8RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward.w1": FP8ColwiseParallel(input_layouts=Shard(1)),
        "feed_forward.w2": FP8RowwiseParallel(output_layouts=Shard(1)),
    })

Each takes the arguments of the torch style it replaces (`input_layouts`, `output_layouts`, `use_local_output`; for
PrepareFP8ModuleInput also `desired_input_layouts` and the kwarg layouts) and shards the parameters the same way, so
checkpoints and optimizers see what torch's styles produce. What differs:

- a sequence-parallel input (`Shard(d)` redistributed to `Replicate()`) of an FP8 layer is all-gathered in FP8 with a
  scale the ranks agree on (lightning_fp8/distributed/sequence_parallel.py): 1 byte per element instead of the
  activation's 4 (float32 under autocast) or 2 (BF16); its backward reduce-scatter moves the gradient's dtype, or FP8
  with `gradient_communication="fp8"`;
- FP8RowwiseParallel's output reduce-scatter (`output_layouts=Shard(d)`) moves the output's dtype, or FP8 with
  `gradient_communication="fp8"`;
- every other redistribution is torch's, in high precision (the all-reduce of `output_layouts=Replicate()`, an
  input that is already replicated);
- they leave the FP8 layer's metadata alone (torch's styles make its buffers replicated DTensors, which the plugins
  and the layer's forward turn back into local tensors; torch's RowwiseParallel would shard a `weight` of every
  submodule, which lightning_fp8.modules.local_shards makes it skip for the FP8 metadata).

torch's own styles split FP8 layers too, before or after conversion, with every collective in high precision (the
layer computes in FP8 on its local shards all the same: lightning_fp8/modules/local_shards.py).

`gradient_communication=None` (the default) follows the FP8 plugin's `gradient_communication` once the plugin sets the
model up ("bf16" without a plugin). The FP8 paths apply where the layer computes in FP8 with a per-tensor recipe;
otherwise (BF16 fallback, `fp8_autocast(enabled=False)`, calibration, fine-grained recipes) the style communicates
as torch's does. The styles may be applied before conversion (to nn.Linear) or after: they check at run time.
"""
from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from lightning_fp8.conversion.summary import PREPARED_ATTR
from lightning_fp8.distributed.sequence_parallel import (
    REDUCE_PRECISIONS,
    InputCast,
    SequenceComm,
    gather_in_fp8,
    reduce_scatter_output,
)
from lightning_fp8.modules.autocast import current_state
from lightning_fp8.modules.linear import FP8Layer
from lightning_fp8.modules.gathered_fp8 import CastKey, GatheredFP8Input
from lightning_fp8.modules.local_shards import LAYOUT_ATTR, TensorParallelLayout, localize_fp8_state

#: set on a module by the styles below: the list of styles applied to it (the plugins resolve their communication)
STYLES_ATTR = "_fp8_tensor_parallel_styles"


_warned_uneven = False


class _FP8Communication:
    """The reduce precision a style uses: its own `gradient_communication`, else the plugin's, else "bf16"."""

    def _init_communication(self, gradient_communication: Optional[str]) -> None:
        if gradient_communication is not None and gradient_communication not in REDUCE_PRECISIONS:
            raise ValueError(f"{type(self).__name__}(gradient_communication={gradient_communication!r}) is not valid; "
                             f"valid choices: {[None, *REDUCE_PRECISIONS]}")
        self.gradient_communication = gradient_communication
        self._plugin_communication: Optional[str] = None

    def follow_plugin(self, gradient_communication: str) -> None:
        """The FP8 plugin's choice, used where the style was given none (set when the plugin adopts the model)."""
        self._plugin_communication = gradient_communication

    @property
    def reduce_precision(self) -> str:
        return self.gradient_communication or self._plugin_communication or "bf16"

    def _mark(self, module: nn.Module) -> None:
        module.__dict__.setdefault(STYLES_ATTR, []).append(self)


def fp8_input_cast(layer: nn.Module) -> Optional[CastKey]:
    """The cast of `layer`'s input in this forward if it is an FP8 layer computing in FP8 with a per-tensor recipe
    (what an FP8 all-gather can feed); None otherwise."""
    if not isinstance(layer, FP8Layer) or not layer.fp8_enabled:
        return None
    state = current_state()
    if not state.enabled or state.calibrating:
        return None
    return CastKey.of(state.recipe or layer.recipe, layer.training, "input")


def _sequence_dim(input_layout, desired_layout, ndim: int) -> Optional[int]:
    """The sequence dimension when a layout change is a sequence-parallel all-gather (Shard(d) of a dimension other
    than the last to Replicate), else None."""
    if not (isinstance(input_layout, Shard) and isinstance(desired_layout, Replicate)):
        return None
    dim = input_layout.dim % ndim
    return dim if dim != ndim - 1 else None


def _gather_or_none(x: Any, layer: nn.Module, input_layout, desired_layout, mesh, style: "_FP8Communication"):
    """The FP8-gathered input (GatheredFP8Input) where this layout change is a sequence-parallel all-gather feeding an
    FP8 layer; None where torch's redistribution applies."""
    if not isinstance(x, torch.Tensor) or isinstance(x, GatheredFP8Input):
        return None
    seq = _sequence_dim(input_layout, desired_layout, x.dim())
    key = fp8_input_cast(layer) if seq is not None else None
    if key is None:
        return None
    if isinstance(x, DTensor):
        if x.shape[seq] % mesh.size() != 0:
            _warn_uneven(x.shape[seq], mesh.size())
            return None
        if tuple(x.placements) != (input_layout,):
            x = x.redistribute(placements=(input_layout,))
        x = x.to_local()
    comm = SequenceComm(mesh.get_group(), seq, style.reduce_precision)
    localize_fp8_state(layer)  # torch's ColwiseParallel on the layer made its FP8 metadata replicated DTensors
    layer.close_pending_step()  # its forward does this first: the cast must use the closed history
    return gather_in_fp8(x, InputCast(layer, key), comm)


def _warn_uneven(length: int, world: int) -> None:
    global _warned_uneven
    if not _warned_uneven:
        _warned_uneven = True
        warnings.warn(f"lightning_fp8: a sequence of length {length} does not split evenly over {world} ranks; its "
                      "sequence-parallel all-gather runs in high precision (torch's).", UserWarning, stacklevel=3)


def _check_mesh(style: object, mesh) -> None:
    if mesh.ndim != 1:
        raise ValueError(f"{type(style).__name__} takes a 1-D (tensor-parallel) device mesh, got {mesh.ndim} dimensions; "
                         "pass mesh['tensor_parallel'] (or your TP dimension's name)")


def _partition_own_parameters(partition, name: str, module: nn.Module, mesh) -> None:
    """torch's partition function applied to the layer itself only: the FP8 metadata submodule has no parameters."""
    if name == "":
        partition(name, module, mesh)


class FP8ColwiseParallel(_FP8Communication, ColwiseParallel):
    """`ColwiseParallel` for FP8 layers (module docstring): same arguments and sharding; a sequence-parallel input
    (`input_layouts=Shard(1)`) is all-gathered in FP8."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 gradient_communication: Optional[str] = None) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self._init_communication(gradient_communication)

    def _prepare_fp8_input(self, mod: nn.Module, inputs: Tuple[Any, ...], device_mesh):
        x = inputs[0]
        if isinstance(x, GatheredFP8Input):
            return x  # gathered in FP8 already (PrepareFP8ModuleInput): the whole input, local
        gathered = _gather_or_none(x, mod, self.input_layouts[0], self.desired_input_layouts[0], device_mesh, self)
        if gathered is not None:
            return gathered
        return ColwiseParallel._prepare_input_fn(self.input_layouts, self.desired_input_layouts, mod, inputs, device_mesh)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            return super()._apply(module, device_mesh)  # nn.Embedding: torch's style, nothing in FP8
        _check_mesh(self, device_mesh)
        distribute_module(
            module, device_mesh, partial(_partition_own_parameters, self._partition_linear_fn),
            self._prepare_fp8_input, partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )
        localize_fp8_state(module)
        module.__dict__[LAYOUT_ATTR] = self
        self._mark(module)
        return module

    def tensor_parallel_layout(self) -> TensorParallelLayout:
        if _sequence_dim(self.input_layouts[0], self.desired_input_layouts[0], 3) is None:
            return TensorParallelLayout("colwise", "FP8ColwiseParallel", None)
        fp8 = "all-gather of the sequence-parallel input"
        if self.reduce_precision == "fp8":
            fp8 += " and reduce-scatter of its gradient"
        return TensorParallelLayout("colwise", "FP8ColwiseParallel", fp8)


class FP8RowwiseParallel(_FP8Communication, RowwiseParallel):
    """`RowwiseParallel` for FP8 layers (module docstring): same arguments and sharding; the output's reduce-scatter
    (`output_layouts=Shard(1)`) in FP8 with `gradient_communication="fp8"`."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 gradient_communication: Optional[str] = None) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self._init_communication(gradient_communication)

    def _prepare_fp8_output(self, mod: nn.Module, outputs, device_mesh):
        (layout,) = self.output_layouts
        # FP8 only where the layer computes in FP8 with per-tensor casts (the module docstring's rule; a BF16
        # fallback communicates as torch's does, as the conversion summary reports)
        if (self.reduce_precision == "fp8" and fp8_input_cast(mod) is not None
                and isinstance(outputs, DTensor) and outputs.placements[0].is_partial()
                and isinstance(layout, Shard) and outputs.shape[layout.dim] % device_mesh.size() == 0):
            seq = layout.dim % outputs.dim()
            local = reduce_scatter_output(outputs.to_local(grad_placements=(Replicate(),)),
                                          SequenceComm(device_mesh.get_group(), seq, "fp8"))
            return local if self.use_local_output else DTensor.from_local(local, device_mesh, (Shard(seq),),
                                                                         run_check=False)
        return RowwiseParallel._prepare_output_fn(self.output_layouts, self.use_local_output, mod, outputs, device_mesh)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            return super()._apply(module, device_mesh)
        _check_mesh(self, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        distribute_module(
            module, device_mesh, partial(_partition_own_parameters, self._partition_linear_fn),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            self._prepare_fp8_output,
        )
        localize_fp8_state(module)
        module.__dict__[LAYOUT_ATTR] = self
        self._mark(module)
        return module

    def tensor_parallel_layout(self) -> TensorParallelLayout:
        reduce_scatter = isinstance(self.output_layouts[0], Shard) and self.reduce_precision == "fp8"
        return TensorParallelLayout("rowwise", "FP8RowwiseParallel",
                                    "reduce-scatter of the output" if reduce_scatter else None)


class PrepareFP8ModuleInput(_FP8Communication, PrepareModuleInput):
    """`PrepareModuleInput` whose sequence-parallel all-gathers (`input_layouts=Shard(1)` to
    `desired_input_layouts=Replicate()`) move FP8, cast once for every FP8 layer of the module that reads the
    input (torchao's PrepareFloat8ModuleInput does the same for its layers).

    fp8_layer: the name, inside the module, of the linear layer whose input scale the cast uses (default: the
    module's first linear layer, in module order: the first reader of its input); the all-gather moves FP8 when that
    layer computes in FP8, high precision otherwise. Every reader must be an `FP8ColwiseParallel` layer. A reader whose cast differs (another
    recipe, a BF16 fallback) gets the exact high-precision input through a second, high-precision all-gather. The
    gathered input is handed over as a local tensor whatever `use_local_output` says: only FP8 layers read it."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_output: bool = False, fp8_layer: Optional[str] = None,
                 gradient_communication: Optional[str] = None) -> None:
        super().__init__(input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
                         input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
                         use_local_output=use_local_output)
        self.fp8_layer = fp8_layer
        self._init_communication(gradient_communication)

    def _scale_layer(self, module: nn.Module) -> Optional[nn.Module]:
        if self.fp8_layer is not None:
            return module.get_submodule(self.fp8_layer)
        return next((m for m in module.modules() if isinstance(m, (nn.Linear, FP8Layer))), None)

    def _prepare_arg(self, module: nn.Module, x: Any, mesh, input_layout, desired_layout):
        layer = self._scale_layer(module) if input_layout is not None else None
        gathered = _gather_or_none(x, layer, input_layout, desired_layout, mesh, self) if layer is not None else None
        if gathered is not None:
            return gathered
        return self._prepare_input_arg(x, mesh, input_layout, desired_layout)

    def _prepare_fp8_inputs(self, module: nn.Module, inputs, mesh):
        if self.input_layouts is None:
            return inputs
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        if len(inputs) != len(self.input_layouts):
            raise ValueError("module inputs and input_layouts should have same length!")
        return tuple(self._prepare_arg(module, x, mesh, layout, desired)
                     for x, layout, desired in zip(inputs, self.input_layouts, self.desired_input_layouts))

    def _prepare_fp8_kwargs(self, module: nn.Module, inputs, kwargs: Dict[str, Any], mesh):
        args = self._prepare_fp8_inputs(module, inputs, mesh)
        prepared = {key: self._prepare_arg(module, value, mesh, self.input_kwarg_layouts.get(key),
                                           self.desired_input_kwarg_layouts.get(key))
                    for key, value in kwargs.items()}
        return args, prepared

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_mesh(self, device_mesh)
        if self.with_kwargs:
            module.register_forward_pre_hook(
                lambda mod, inputs, kwargs: self._prepare_fp8_kwargs(mod, inputs, kwargs, device_mesh), with_kwargs=True)
        else:
            module.register_forward_pre_hook(lambda mod, inputs: self._prepare_fp8_inputs(mod, inputs, device_mesh))
        pairs = list(zip(self.input_layouts or (), self.desired_input_layouts or ()))
        pairs += [(layout, self.desired_input_kwarg_layouts.get(key)) for key, layout in self.input_kwarg_layouts.items()]
        if any(_sequence_dim(layout, desired, 3) is not None for layout, desired in pairs):
            module.__dict__[PREPARED_ATTR] = self  # it gathers a sequence-parallel input (the summary lists it)
        self._mark(module)
        return module


def follow_plugin_communication(model: nn.Module, gradient_communication: str) -> int:
    """Tell every lightning_fp8 style applied in `model` the plugin's gradient_communication (styles given their own
    keep it); returns how many styles there are."""
    count = 0
    for module in model.modules():
        for style in module.__dict__.get(STYLES_ATTR, ()):
            style.follow_plugin(gradient_communication)
            count += 1
    return count
