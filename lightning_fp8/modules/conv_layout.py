"""The layout side of an FP8 convolution: a convolution as GEMMs over unfolded input ("im2col"), and back.

A convolution of x (N, C, H, W) with a weight (O, C/g, kh, kw) is, for each of its g groups, one GEMM:

    cols (N*Ho*Wo, kh*kw*C/g)  @  W_g^T (kh*kw*C/g, O/g)  ->  y (N*Ho*Wo, O/g)

where row (n, ho, wo) of `cols` holds the input window that output position reads, in (kh, kw, c) order (channels
innermost: copying a window out of channels-last data moves runs of C/g contiguous values, where torch's (c, kh, kw)
order moves single elements). A 1x1 convolution with stride 1 and no padding on channels-last data is the GEMM
itself: `cols` is a view, nothing copied.

The input gradient, two ways:
- stride 1 (`input_gradient_geometry`): it is itself a convolution, of dy with the weight flipped and its in/out
  channels swapped (`flipped_weight_matrix`), so the same unfold + one GEMM, accumulated and rounded inside the GEMM;
- strided: the transposed GEMM dcols = dy @ W_g in float32 followed by "col2im" (`col2im_add_`): every column entry
  added back onto the input position it came from (the stride-1 form would multiply zeros inserted between the
  gradient's rows: 4x the work at stride 2).

Everything here moves values and never computes with them, so it works on FP8 tensors (1 byte per element: the
unfold of an FP8 input moves k*k bytes per input element, not k*k*2 or k*k*4) and on high-precision ones alike.
Padding writes zeros (byte 0 is +0.0 in both FP8 formats). Dimensions are always 2-D here: a Conv1d is the
(1, k) case of a Conv2d.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import nn

Tensor = torch.Tensor

#: padding modes nn.Conv1d / nn.Conv2d accept; every one is supported ("zeros" inside the unfold, the others by
#: padding the high-precision input with F.pad first, as nn.Conv2d itself does)
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


class ConvGeometry(NamedTuple):
    """Where a convolution's windows lie: kernel, stride and dilation as (h, w), zero padding as (top, bottom, left,
    right) (asymmetric for padding="same" with an even kernel), groups. Primitives only, so torch.compile can
    specialise on it."""

    kernel: Tuple[int, int]
    stride: Tuple[int, int]
    dilation: Tuple[int, int]
    padding: Tuple[int, int, int, int]
    groups: int

    @staticmethod
    def of(conv: nn.Module) -> "ConvGeometry":
        """The geometry of an nn.Conv1d / nn.Conv2d's GEMMs. A padding mode other than "zeros" contributes no zero
        padding here: the layer pads its input with that mode first (F.pad, as nn.Conv2d does)."""
        two_d = len(conv.kernel_size) == 2
        kernel = tuple(conv.kernel_size) if two_d else (1, conv.kernel_size[0])
        stride = tuple(conv.stride) if two_d else (1, conv.stride[0])
        dilation = tuple(conv.dilation) if two_d else (1, conv.dilation[0])
        if conv.padding_mode != "zeros":
            padding = (0, 0, 0, 0)
        else:
            # nn.Conv's own reading of padding=int / tuple / "same" / "valid": (left, right, top, bottom) for 2-D
            rev = conv._reversed_padding_repeated_twice
            padding = (rev[2], rev[3], rev[0], rev[1]) if two_d else (0, 0, rev[0], rev[1])
        return ConvGeometry(kernel, stride, dilation, tuple(int(p) for p in padding), int(conv.groups))

    def output_size(self, h: int, w: int) -> Tuple[int, int]:
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        top, bottom, left, right = self.padding
        return (h + top + bottom - dh * (kh - 1) - 1) // sh + 1, (w + left + right - dw * (kw - 1) - 1) // sw + 1

    @property
    def is_pointwise(self) -> bool:
        """A 1x1 convolution with stride 1 and no padding: the GEMM reads the input as it is."""
        return self.kernel == (1, 1) and self.stride == (1, 1) and self.padding == (0, 0, 0, 0)


def is_channels_last(x: Tensor) -> bool:
    """Whether a 4-D tensor is laid out channels-last (NHWC) rather than contiguous NCHW."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def padded_nhwc(x: Tensor, geometry: ConvGeometry) -> Tensor:
    """x (N, C, H, W), any layout and dtype (FP8 included) -> (N, H+top+bottom, W+left+right, C) contiguous, zero
    border: the tensor the windows are read from. No copy for channels-last data without padding."""
    top, bottom, left, right = geometry.padding
    nhwc = x.permute(0, 2, 3, 1)
    if not (top or bottom or left or right):
        return nhwc.contiguous()
    n, c, h, w = x.shape
    out = torch.zeros((n, h + top + bottom, w + left + right, c), dtype=x.dtype, device=x.device)
    out[:, top:top + h, left:left + w, :].copy_(nhwc)
    return out


def _windows(xp: Tensor, geometry: ConvGeometry, group: int, out_hw: Tuple[int, int]) -> Tensor:
    """(N, Ho, Wo, kh, kw, C/g): the input window of every output position of group `group`, a view of xp."""
    n, _, _, c = xp.shape
    cg = c // geometry.groups
    src = xp[..., group * cg:(group + 1) * cg] if geometry.groups > 1 else xp
    (kh, kw), (sh, sw), (dh, dw) = geometry.kernel, geometry.stride, geometry.dilation
    s_n, s_h, s_w, s_c = src.stride()
    return src.as_strided((n, out_hw[0], out_hw[1], kh, kw, cg), (s_n, sh * s_h, sw * s_w, dh * s_h, dw * s_w, s_c))


def im2col(xp: Tensor, geometry: ConvGeometry, group: int, out_hw: Tuple[int, int], transposed: bool = False) -> Tensor:
    """The GEMM operand of group `group`: (N*Ho*Wo, kh*kw*C/g) from `padded_nhwc`'s result, row-major (a view when
    the convolution is pointwise), or, with transposed=True, the same matrix column-major (its transpose written
    contiguously: the layout `torch._scaled_mm` wants for the second operand of the weight-gradient GEMM)."""
    win = _windows(xp, geometry, group, out_hw)
    m = win.shape[0] * win.shape[1] * win.shape[2]
    k = win.shape[3] * win.shape[4] * win.shape[5]
    if transposed:
        # contiguous: for a 1x1 kernel the reshape can be a view, row-major, which the scaled GEMM would copy
        return win.permute(3, 4, 5, 0, 1, 2).reshape(k, m).contiguous().t()
    return win.reshape(m, k)


def input_gradient_geometry(geometry: ConvGeometry) -> Optional[ConvGeometry]:
    """The geometry of the convolution that computes the input gradient (of dy, padded, with the flipped weight),
    for a stride-1 convolution whose padding does not exceed the kernel's reach dilation*(kernel-1); None otherwise
    (col2im then). Its output is the input's size: H + reach - reach."""
    if geometry.stride != (1, 1):
        return None
    (kh, kw), (dh, dw) = geometry.kernel, geometry.dilation
    top, bottom, left, right = geometry.padding
    reach_h, reach_w = dh * (kh - 1), dw * (kw - 1)
    padding = (reach_h - top, reach_h - bottom, reach_w - left, reach_w - right)
    if min(padding) < 0:
        return None
    return ConvGeometry(geometry.kernel, (1, 1), geometry.dilation, padding, geometry.groups)


def flipped_weight_matrix(weight: Tensor, group: int, groups: int) -> Tensor:
    """The weight of the input gradient's convolution for group `group`: W'[c, i, j, o] = W[o, c, kh-1-i, kw-1-j] as a
    (C/g, kh*kw*O/g) matrix, row-major (a copy; torch has no flip for FP8 dtypes, so the bytes are flipped)."""
    og = weight.shape[0] // groups
    w = weight[group * og:(group + 1) * og] if groups > 1 else weight
    raw = w.view(torch.uint8) if w.element_size() == 1 and w.is_floating_point() else w
    # contiguous: for a 1x1 kernel the reshape is a view of the flip, column-major, which the scaled GEMM would copy
    flipped = raw.flip(2, 3).permute(1, 2, 3, 0).reshape(w.shape[1], -1).contiguous()
    return flipped.view(w.dtype) if raw is not w else flipped


def col2im_add_(dxp: Tensor, cols: Tensor, geometry: ConvGeometry, group: int, out_hw: Tuple[int, int]) -> None:
    """Add every entry of `cols` (N*Ho*Wo, kh*kw*C/g), the input gradient per window of group `group`, onto the
    position of `dxp` (N, Hp, Wp, C) it was read from: kh*kw strided additions, in dxp's dtype (float32 for the
    FP8 layers: these sums are part of the input gradient's accumulation)."""
    n, _, _, c = dxp.shape
    cg = c // geometry.groups
    (kh, kw), (sh, sw), (dh, dw) = geometry.kernel, geometry.stride, geometry.dilation
    ho, wo = out_hw
    blocks = cols.view(n, ho, wo, kh, kw, cg)
    channels = slice(group * cg, (group + 1) * cg)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (ho - 1) + 1, sh)
            columns = slice(j * dw, j * dw + sw * (wo - 1) + 1, sw)
            dxp[:, rows, columns, channels] += blocks[:, :, :, i, j, :]


def crop_to_input(dxp: Tensor, geometry: ConvGeometry, h: int, w: int) -> Tensor:
    """The (N, C, H, W) view of the unpadded part of a padded NHWC tensor."""
    top, _, left, _ = geometry.padding
    return dxp[:, top:top + h, left:left + w, :].permute(0, 3, 1, 2)


def weight_matrix(weight: Tensor, group: int, groups: int, transposed: bool = False) -> Tensor:
    """Group `group`'s weight (O/g, C/g, kh, kw) as the GEMM's (O/g, kh*kw*C/g) matrix in the columns' (kh, kw, c)
    order: row-major, or column-major with transposed=True (a copy either way, 1 byte per element in FP8)."""
    og = weight.shape[0] // groups
    w = weight[group * og:(group + 1) * og] if groups > 1 else weight
    if transposed:
        return w.permute(2, 3, 1, 0).reshape(-1, og).contiguous().t()  # contiguous: a view for 1x1 kernels
    return w.permute(0, 2, 3, 1).reshape(og, -1)


def weight_from_matrix(dw: Tensor, weight_shape: torch.Size) -> Tensor:
    """A (O, kh*kw*C/g) gradient in the columns' order back to the weight's (O, C/g, kh, kw) shape (a view)."""
    o, cg, kh, kw = weight_shape
    return dw.reshape(o, kh, kw, cg).permute(0, 3, 1, 2)
