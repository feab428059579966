"""Which module classes conversion can put in FP8, and how every other GEMM-bearing module is named.

A *linear kind* is a class whose forward is GEMMs with a weight, y = x W^T + b in some storage layout, with the FP8
layer that replaces it:

    nn.Linear                        -> FP8Linear  (lightning_fp8/modules/linear.py)
    transformers.pytorch_utils.Conv1D -> FP8Conv1D (lightning_fp8/modules/hf_conv1d.py), GPT-2's projections
    MultiheadAttentionProjection     -> FP8MultiheadAttentionProjection (lightning_fp8/modules/multihead_attention.py): the q, k
                                        and v rows of an nn.MultiheadAttention made a module (conversion/torch_transformer.py)
    nn.Conv1d / nn.Conv2d            -> FP8Conv1d / FP8Conv2d (lightning_fp8/modules/conv.py): one GEMM per group
                                        over the unfolded input; their `family` is "convolution"

The registry holds *names*, not classes: a kind is looked up only when the module that defines its class is already
imported (a model cannot hold a `Conv1D` unless transformers is imported), so lightning-fp8 never imports transformers
itself. `register_linear_kind` adds a class of your own.

`other_module(module)` names the modules conversion leaves alone and why (transposed and 3-D convolutions, recurrent
layers, nn.MultiheadAttention's fused input projection, layers another FP8 library already converted, subclasses that
replace their class's forward), so the precision map covers every module that runs a GEMM-like operation.
"""
from __future__ import annotations

import importlib
import math
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from torch import nn
from torch.nn.utils import parametrize

from lightning_fp8.modules.conv import FP8ConvNd
from lightning_fp8.modules.grouped_linear import FP8GroupedLinear
from lightning_fp8.modules.linear import FP8Layer
from lightning_fp8.recipe import FP8Recipe


@dataclass(frozen=True)
class LinearKind:
    """A linear-like module class and the FP8 layer that replaces it.

    source: the class's qualified name ("module.Class"); fp8_class: "module:Class" of its FP8Layer;
    features(module) -> (in_features, out_features) of its GEMMs (a convolution: (C/groups x kernel, out channels),
    so in x out is its multiply-adds per output position); build(fp8_class, module, recipe) -> the FP8 layer, reusing
    the module's Parameters; weight_transposed: the weight is stored (in, out) instead of (out, in); family: "linear"
    or "convolution" (how the conversion summary counts it); weight_shape(module): the weight's shape where it is not
    the (out, in) matrix (a convolution's (out, in/groups, *kernel))."""

    label: str
    source: str
    fp8_class: str
    features: Callable[[nn.Module], Tuple[int, int]]
    build: Callable[[type, nn.Module, FP8Recipe], FP8Layer]
    weight_transposed: bool = False
    family: str = "linear"
    weight_shape: Optional[Callable[[nn.Module], Tuple[int, ...]]] = None

    def tensor_shapes(self, module: nn.Module) -> Dict[str, Tuple[int, ...]]:
        """The shapes the FP8 layer relies on: its weight's and its bias's."""
        in_f, out_f = self.features(module)
        if self.weight_shape is not None:
            weight = tuple(self.weight_shape(module))
        else:
            weight = (in_f, out_f) if self.weight_transposed else (out_f, in_f)
        return {"weight": weight, "bias": (out_f,)}

    def source_class(self) -> Optional[type]:
        """The class, if its module is imported (else no instance can exist)."""
        module_name, _, class_name = self.source.rpartition(".")
        module = sys.modules.get(module_name)
        return getattr(module, class_name, None) if module is not None else None

    def fp8_layer_class(self) -> type:
        """The FP8 layer class; raises ImportError with the reason when it cannot be imported."""
        module_name, _, class_name = self.fp8_class.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name, None)
        if cls is None:
            why = getattr(sys.modules.get(module_name), "IMPORT_ERROR", None) or "not defined"
            raise ImportError(f"{self.fp8_class} is not available ({why})")
        return cls

    def convert(self, module: nn.Module, recipe: FP8Recipe) -> FP8Layer:
        """The FP8 layer for `module`; for a subclass of the source class (one that keeps its forward), an FP8 class
        that also extends that subclass, so the layer stays an instance of it and keeps its other methods."""
        fp8_class = self.fp8_layer_class()
        cls = base_class(module)
        if cls is not self.source_class():
            fp8_class = fp8_subclass(fp8_class, cls)
        return self.build(fp8_class, module, recipe)


_FP8_SUBCLASSES: Dict[Tuple[type, type], type] = {}
#: on an FP8 class made by `fp8_subclass`: the class `revert_fp8` gives back
SOURCE_CLASS_ATTR = "_fp8_source_class"


def fp8_subclass(fp8_class: type, cls: type) -> type:
    """`class FP8<cls>(fp8_class, cls)`: the FP8 forward first in the MRO, then `cls`'s methods (made once)."""
    key = (fp8_class, cls)
    if key not in _FP8_SUBCLASSES:
        _FP8_SUBCLASSES[key] = type(f"FP8{cls.__name__}", (fp8_class, cls), {SOURCE_CLASS_ATTR: cls,
                                                                            "__module__": cls.__module__})
    return _FP8_SUBCLASSES[key]


LINEAR = LinearKind(
    label="nn.Linear",
    source="torch.nn.modules.linear.Linear",
    fp8_class="lightning_fp8.modules.linear:FP8Linear",
    features=lambda m: (m.in_features, m.out_features),
    build=lambda cls, m, recipe: cls.from_linear(m, recipe),
)
HF_CONV1D = LinearKind(
    label="transformers Conv1D",
    source="transformers.pytorch_utils.Conv1D",
    fp8_class="lightning_fp8.modules.hf_conv1d:FP8Conv1D",
    features=lambda m: (m.nx, m.nf),
    build=lambda cls, m, recipe: cls.from_conv1d(m, recipe),
    weight_transposed=True,
)
MHA_PROJECTION = LinearKind(
    label="nn.MultiheadAttention projection",
    source="lightning_fp8.modules.multihead_attention.MultiheadAttentionProjection",
    fp8_class="lightning_fp8.modules.multihead_attention:FP8MultiheadAttentionProjection",
    features=lambda m: (m.in_features, m.out_features),
    build=lambda cls, m, recipe: cls.from_projection(m, recipe),
)


def _conv_features(m: nn.Module) -> Tuple[int, int]:
    return m.in_channels // m.groups * math.prod(m.kernel_size), m.out_channels


def _conv_weight_shape(m: nn.Module) -> Tuple[int, ...]:
    return (m.out_channels, m.in_channels // m.groups, *m.kernel_size)


CONV1D = LinearKind(
    label="nn.Conv1d",
    source="torch.nn.modules.conv.Conv1d",
    fp8_class="lightning_fp8.modules.conv:FP8Conv1d",
    features=_conv_features,
    build=lambda cls, m, recipe: cls.from_conv(m, recipe),
    family="convolution",
    weight_shape=_conv_weight_shape,
)
CONV2D = LinearKind(
    label="nn.Conv2d",
    source="torch.nn.modules.conv.Conv2d",
    fp8_class="lightning_fp8.modules.conv:FP8Conv2d",
    features=_conv_features,
    build=lambda cls, m, recipe: cls.from_conv(m, recipe),
    family="convolution",
    weight_shape=_conv_weight_shape,
)
#: the convolution classes and their kinds: a subclass counts when it keeps the class's forward and _conv_forward
_CONV_KINDS = ((nn.Conv1d, CONV1D), (nn.Conv2d, CONV2D))
#: the kinds `linear_kind` matches by base class (subclasses included) before the exact-class lookup of the others
_BUILT_IN_BY_BASE_CLASS = (LINEAR, CONV1D, CONV2D)

_KINDS: List[LinearKind] = [LINEAR, HF_CONV1D, MHA_PROJECTION, CONV1D, CONV2D]


def register_linear_kind(kind: LinearKind) -> None:
    """Let conversion put instances of `kind.source` in FP8 (its FP8 layer: `FP8Layer` mixed into that class, with
    `fp8_weight()` and `to_unconverted()`, see lightning_fp8/modules/hf_conv1d.py for an example)."""
    if not isinstance(kind, LinearKind):
        raise TypeError(f"register_linear_kind expects a LinearKind, got {type(kind).__name__}")
    _KINDS[:] = [k for k in _KINDS if k.source != kind.source] + [kind]


def base_class(module: nn.Module) -> type:
    """The module's class before torch parametrizations replaced it by a generated subclass."""
    return parametrize.type_before_parametrizations(module)


def linear_kind(module: nn.Module) -> Optional[LinearKind]:
    """The kind of a linear layer conversion can put in FP8, or None.

    nn.Linear / nn.Conv1d / nn.Conv2d subclasses take the built-in kind only when they keep its forward (e.g.
    nn.MultiheadAttention's out_proj class): a subclass with its own forward computes something else, and the
    built-in FP8 layer would drop that forward. Such a subclass converts only through a kind registered for exactly
    its class (`register_linear_kind`), as any other class does."""
    if isinstance(module, FP8Layer):
        return None
    cls = base_class(module)
    if issubclass(cls, nn.Linear) and cls.forward is nn.Linear.forward:
        return LINEAR
    for conv_class, kind in _CONV_KINDS:
        if issubclass(cls, conv_class) and _keeps_conv_forward(cls, conv_class):
            return kind
    for kind in _KINDS:
        if kind not in _BUILT_IN_BY_BASE_CLASS and cls is kind.source_class() and _available(kind):
            return kind
    return None


def _keeps_conv_forward(cls: type, conv_class: type) -> bool:
    """A convolution subclass computes what its class does only if it keeps both forward and _conv_forward (weight
    standardization and "same"-padding variants override one of them)."""
    return cls.forward is conv_class.forward and cls._conv_forward is conv_class._conv_forward


def _available(kind: LinearKind) -> bool:
    try:
        kind.fp8_layer_class()
    except ImportError:
        return False
    return True


def _kind_of_fp8_layer(layer: FP8Layer) -> Optional[LinearKind]:
    """The kind whose FP8 class `layer` is (or extends: an FP8 class made by fp8_subclass); the most derived class
    that is some kind's FP8 class wins, so a registered kind's subclass of FP8Conv2d is found before CONV2D."""
    for klass in base_class(layer).__mro__:
        for kind in reversed(_KINDS):  # registered kinds, appended last, before the built-in ones
            if kind.fp8_class == f"{klass.__module__}:{klass.__name__}":
                return kind
    return None


def label(module: nn.Module) -> str:
    """The kind's label of a linear layer, converted or not ("nn.Linear", "transformers Conv1D"); an experts
    module's FP8 GEMM says whose projection it is."""
    if isinstance(module, FP8GroupedLinear):
        return module.label
    cls = base_class(module)
    kind = _kind_of_fp8_layer(module) if isinstance(module, FP8Layer) else linear_kind(module)
    return kind.label if kind is not None else cls.__name__


def family(module: nn.Module) -> str:
    """"linear" or "convolution": the family of a linear-kind layer, converted or not (of its kind, registered
    kinds included); "experts" for an experts module's FP8 GEMM."""
    if isinstance(module, FP8GroupedLinear):
        return "experts"
    if isinstance(module, FP8Layer):
        kind = _kind_of_fp8_layer(module)
        if kind is None:
            return "convolution" if isinstance(module, FP8ConvNd) else "linear"
        return kind.family
    kind = linear_kind(module)
    return kind.family if kind is not None else "linear"


def features(module: nn.Module) -> Tuple[int, int]:
    """(in_features, out_features) of a linear-like module (FP8 layers included)."""
    if isinstance(module, FP8Layer):
        return module.in_features, module.out_features
    kind = linear_kind(module)
    if kind is None:
        raise TypeError(f"{type(module).__name__} is not a linear layer conversion knows")
    return kind.features(module)


# -- modules conversion leaves alone ------------------------------------------------------------------------------
#: top-level packages of other FP8 libraries whose linear layers already run in FP8
FOREIGN_FP8 = {"torchao": "torchao", "transformer_engine": "Transformer Engine", "msamp": "MS-AMP"}
#: class names of those libraries' FP8 GEMM modules (their containers hold these, which are listed one by one)
FOREIGN_FP8_CLASSES = {"Float8Linear", "MXLinear", "Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear",
                       "FP8Linear", "ScalingLinear"}

NO_FP8_PATH = "no FP8 path (FP8 covers nn.Linear, transformers' Conv1D, nn.MultiheadAttention's projections, nn.Conv1d and nn.Conv2d)"


@dataclass(frozen=True)
class OtherModule:
    """A module that runs a GEMM-like operation but that conversion leaves as it is."""

    precision: str  # "fp8" (converted by another library) or "bf16"
    reason: str
    label: str
    flops_per_token: int = 0
    family: str = "linear"  # "linear", "convolution" or "recurrent": how the conversion summary counts it


def other_module(module: nn.Module) -> Optional[OtherModule]:
    """How the precision map names a GEMM-bearing module that is not a convertible linear, or None for any other."""
    if isinstance(module, FP8Layer) or linear_kind(module) is not None:
        return None
    cls = base_class(module)
    package = cls.__module__.split(".")[0]
    name = cls.__name__
    if package == "lightning_fp8":
        return None  # the FP8 layers' own parts (fp8_meta)
    if (package in FOREIGN_FP8 and name in FOREIGN_FP8_CLASSES) or (_fp8_by_name(name) and hasattr(module, "weight")):
        flops = _flops_if_linear(module)
        return OtherModule(
            "fp8",
            f"converted to FP8 by {FOREIGN_FP8.get(package, package)} ({cls.__module__}.{name}); its scales are "
            "managed by that library, not by lightning_fp8",
            f"{FOREIGN_FP8.get(package, package)} {name}",
            flops,
        )
    if issubclass(cls, nn.Linear):
        return OtherModule(
            "bf16",
            f"{cls.__module__}.{name} replaces nn.Linear.forward: converting it would drop that forward, so it is "
            "left as it is",
            name,
            _flops_if_linear(module),
        )
    if name == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        return OtherModule("bf16", _conv1d_reason(cls), name, module.nx * module.nf)
    if isinstance(module, nn.MultiheadAttention):
        if hasattr(module, "q_proj"):  # a ProjectedMultiheadAttention: its projections are rows of their own
            return None
        e = module.embed_dim
        why = module.__dict__.get("_fp8_attention_reason") or (
            "not converted (a subclass with its own forward, or not in the model when convert_to_fp8 ran)")
        return OtherModule(
            "bf16",
            f"nn.MultiheadAttention's input projection (in_proj_weight: q, k, v): {why}",
            "MultiheadAttention (in_proj)",
            e * e + module.kdim * e + module.vdim * e,
        )
    for conv_class in (nn.Conv1d, nn.Conv2d):
        if issubclass(cls, conv_class):  # a subclass that replaces forward or _conv_forward (linear_kind said no)
            return OtherModule(
                "bf16",
                f"{cls.__module__}.{name} replaces {conv_class.__name__}.forward or _conv_forward: converting it "
                "would drop that code, so it is left as it is",
                name, 0, "convolution",
            )
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return OtherModule("bf16", f"transposed convolution: {NO_FP8_PATH}", name, 0, "convolution")
    if isinstance(module, nn.Conv3d):
        return OtherModule("bf16", f"3-D convolution: {NO_FP8_PATH}", name, 0, "convolution")
    if isinstance(module, nn.modules.conv._ConvNd):
        return OtherModule("bf16", f"convolution: {NO_FP8_PATH}", name, 0, "convolution")
    if isinstance(module, nn.RNNBase):
        return OtherModule("bf16", _recurrent_reason(module), name, _recurrent_flops(module), "recurrent")
    if isinstance(module, nn.Bilinear):
        return OtherModule("bf16", f"bilinear layer: {NO_FP8_PATH}", name)
    return None


#: GEMMs per time step and layer of each recurrent class (input and hidden projections of every gate)
_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def _recurrent_reason(module: nn.RNNBase) -> str:
    return (f"recurrent layer ({type(module).__name__}): its input and hidden projections run inside one fused kernel "
            "over all time steps (torch's _VF / cuDNN RNN), never through a linear module: " + NO_FP8_PATH
            + "; to run one in FP8, write the recurrence with nn.Linear layers (they convert like any other)")


def _recurrent_flops(module: nn.RNNBase) -> int:
    """Multiply-adds per token of every layer and direction: gates x hidden x (input + hidden)."""
    gates = _GATES.get(module.mode, 1)
    directions = 2 if module.bidirectional else 1
    hidden = module.hidden_size
    proj = module.proj_size if getattr(module, "proj_size", 0) else hidden
    total = 0
    for layer in range(module.num_layers):
        inputs = module.input_size if layer == 0 else proj * directions
        total += directions * gates * hidden * (inputs + proj)
    return total


def _fp8_by_name(name: str) -> bool:
    """An FP8 linear of a library not listed above, by its class name (e.g. transformers' FbgemmFp8Linear)."""
    lowered = name.lower()
    return ("fp8" in lowered or "float8" in lowered) and "linear" in lowered


def _flops_if_linear(module: nn.Module) -> int:
    in_f, out_f = getattr(module, "in_features", 0), getattr(module, "out_features", 0)
    return in_f * out_f if isinstance(in_f, int) and isinstance(out_f, int) else 0


def _conv1d_reason(cls: type) -> str:
    """Why a class named Conv1D stays as it is: transformers' own class whose FP8 layer cannot be built, or a
    lookalike (told apart without importing transformers: its class is transformers' only if that is imported)."""
    if cls is HF_CONV1D.source_class():
        try:
            HF_CONV1D.fp8_layer_class()
        except ImportError as error:
            return f"{cls.__module__}.Conv1D: FP8Conv1D needs transformers, which cannot be imported here ({error})"
    return f"{cls.__module__}.Conv1D is not {HF_CONV1D.source} (the Conv1D FP8 supports): {NO_FP8_PATH}"
