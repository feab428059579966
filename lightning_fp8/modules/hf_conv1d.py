"""FP8Conv1D: transformers' `Conv1D` (GPT-2's projections) with its three GEMMs in FP8.

`Conv1D` is a linear layer whose weight is stored transposed: `y = x @ weight + bias` with `weight` of shape
(in, out) = (nx, nf). FP8Conv1D is `FP8Layer` mixed into `Conv1D`: it keeps the `weight` / `bias` Parameters and
their state_dict keys (a checkpoint or `save_pretrained` export is byte-for-byte the original model's), stays an
instance of `Conv1D`, and hands the FP8 path `weight.t()`, a view (no copy), so the gradient the FP8 weight-gradient
GEMM computes flows back into the real Parameter through the transpose.

transformers is not a dependency of lightning-fp8: this module is imported by conversion only when a model holds a
`Conv1D` (lightning_fp8/conversion/layer_kinds.py), which means transformers is already imported. `FP8Conv1D` is None where
transformers cannot be imported.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lightning_fp8.modules.linear import FP8Layer
from lightning_fp8.recipe import FP8Recipe

try:  # transformers is optional
    from transformers.pytorch_utils import Conv1D
except Exception as error:  # ImportError, or a broken install that fails while importing
    Conv1D = None
    IMPORT_ERROR: Optional[str] = f"{type(error).__name__}: {error}"
else:
    IMPORT_ERROR = None


if Conv1D is not None:

    class FP8Conv1D(FP8Layer, Conv1D):
        """transformers' Conv1D whose GEMMs run in FP8 (see the module docstring). Build it with `from_conv1d`."""

        @property
        def in_features(self) -> int:
            return self.nx

        @property
        def out_features(self) -> int:
            return self.nf

        def fp8_weight(self) -> torch.Tensor:
            # (out, in) view of the (in, out) Parameter: the FP8 path's y = x W^T + b is Conv1D's x @ weight + b
            return self.weight.t()

        @classmethod
        def from_conv1d(cls, conv: nn.Module, recipe: Optional[FP8Recipe] = None) -> "FP8Conv1D":
            """Wrap an existing Conv1D, reusing its Parameters (optimizer references and weight tying survive)."""
            new = cls.__new__(cls)
            nn.Module.__init__(new)
            new.nf = conv.nf
            new.nx = conv.nx
            new.weight = conv.weight
            new.bias = conv.bias
            new.train(conv.training)
            new._init_fp8(recipe, device=conv.weight.device)
            return new

        def to_unconverted(self) -> nn.Module:
            conv = Conv1D.__new__(Conv1D)
            nn.Module.__init__(conv)
            conv.nf = self.nf
            conv.nx = self.nx
            conv.weight = self.weight
            conv.bias = self.bias
            conv.train(self.training)
            return conv

        # Conv1D defines __repr__ itself; show the FP8 state like every other FP8 layer does
        __repr__ = nn.Module.__repr__

        def extra_repr(self) -> str:
            return f"nf={self.nf}, nx={self.nx}" + FP8Layer.extra_repr(self)

else:
    FP8Conv1D = None
