"""nn.MultiheadAttention with its four projections as modules, so they can compute in FP8.

`nn.MultiheadAttention` applies its input projection (`in_proj_weight`: q, k and v stacked, or `q_proj_weight`,
`k_proj_weight`, `v_proj_weight` when kdim / vdim differ) and its `out_proj` inside `F.multi_head_attention_forward`,
never through a module call, so no linear layer of it can be replaced. Conversion therefore first turns each one into
a `ProjectedMultiheadAttention` (its class changed in place: same object, same Parameters, same state_dict keys,
hooks kept), whose forward calls four projection modules:

    q_proj, k_proj, v_proj   `MultiheadAttentionProjection`: rows of the attention's own in_proj_weight (a view,
                             read at every call, so an FSDP2-gathered or a loaded weight is always the one used)
    out_proj                 the attention's own out_proj (an nn.Linear subclass), called as a module

and computes the attention itself exactly as torch does (scaled_dot_product_attention, or the explicit softmax when
attention weights are asked for), in the compute dtype under autocast: only the projections run in FP8, the practice
the FP8 training guides recommend (attention scores keep 16 bits). The projections are then ordinary linear layers for
conversion (`FP8MultiheadAttentionProjection` is the FP8 one), the precision map, first/last, fallback and the monitor.

`FastPathFree` mixes into nn.TransformerEncoderLayer / nn.TransformerEncoder holding FP8 projections: their inference
fast path (eval, no autocast, no grad) calls torch's fused kernels on the Parameters directly, which would bypass the
FP8 layers; the mixin runs the modules instead (`torch.backends.mha.set_fastpath_enabled(False)` for the call).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fp8.modules.linear import FP8Layer
from lightning_fp8.recipe import FP8Recipe

#: the names of the input projections a ProjectedMultiheadAttention calls, in q, k, v order
PROJECTION_NAMES = ("q_proj", "k_proj", "v_proj")


class MultiheadAttentionProjection(nn.Module):
    """y = x W^T + b where W is rows `rows` of the owning attention's `weight_name` Parameter (all of it when None)
    and b the same rows of its in_proj_bias. Holds no Parameter of its own: state_dict keys stay the attention's."""

    def __init__(self, owner: nn.MultiheadAttention, weight_name: str, rows: Optional[Tuple[int, int]],
                 bias_rows: Tuple[int, int], in_features: int, out_features: int) -> None:
        super().__init__()
        self.__dict__["_owner"] = owner  # not a submodule: the attention owns this module, not the reverse
        self.weight_name = weight_name
        self.rows = rows
        self.bias_rows = bias_rows
        self.in_features = in_features
        self.out_features = out_features

    @property
    def weight(self) -> Tensor:
        weight = getattr(self._owner, self.weight_name)
        return weight if self.rows is None else weight[self.rows[0]:self.rows[1]]

    @property
    def bias(self) -> Optional[Tensor]:
        bias = self._owner.in_proj_bias
        return None if bias is None else bias[self.bias_rows[0]:self.bias_rows[1]]

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        rows = "" if self.rows is None else f"[{self.rows[0]}:{self.rows[1]}]"
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={self.weight_name}{rows}"

    def _fields(self) -> dict:
        return {name: self.__dict__[name] for name in ("_owner", "weight_name", "rows", "bias_rows", "in_features",
                                                       "out_features")}


class FP8MultiheadAttentionProjection(FP8Layer, MultiheadAttentionProjection):
    """An attention projection whose three GEMMs run in FP8 (its weight: the view of the attention's Parameter)."""

    @classmethod
    def from_projection(cls, projection: MultiheadAttentionProjection,
                        recipe: Optional[FP8Recipe] = None) -> "FP8MultiheadAttentionProjection":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.__dict__.update(projection._fields())
        new.train(projection.training)
        new._init_fp8(recipe, device=projection.weight.device)
        return new

    def fp8_weight(self) -> Tensor:
        return self.weight

    def to_unconverted(self) -> MultiheadAttentionProjection:
        plain = MultiheadAttentionProjection.__new__(MultiheadAttentionProjection)
        nn.Module.__init__(plain)
        plain.__dict__.update(self._fields())
        plain.train(self.training)
        return plain


def projections_for(attention: nn.MultiheadAttention) -> Tuple[MultiheadAttentionProjection, ...]:
    """The q, k and v projections of `attention` (reading its Parameters; nothing is copied)."""
    e = attention.embed_dim
    bias_rows = [(0, e), (e, 2 * e), (2 * e, 3 * e)]
    if attention._qkv_same_embed_dim:
        return tuple(MultiheadAttentionProjection(attention, "in_proj_weight", rows, rows, e, e) for rows in bias_rows)
    dims = (e, attention.kdim, attention.vdim)
    return tuple(MultiheadAttentionProjection(attention, f"{name}_weight", None, rows, dim, e)
                 for name, rows, dim in zip(PROJECTION_NAMES, bias_rows, dims))


class ProjectedMultiheadAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention computing its projections through the modules q_proj, k_proj, v_proj and out_proj (see
    the module docstring). Same arguments, results and attention weights as nn.MultiheadAttention.forward (up to
    floating-point summation order: q, k and v are three GEMMs here, one packed GEMM there)."""

    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        is_batched = query.dim() == 3
        key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                             other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                             target_type=query.dtype)
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        if self.batch_first and is_batched:  # (L, N, E) inside, as torch computes it
            query, key, value = _same_identities(lambda x: x.transpose(1, 0), query, key, value)
        out, weights = self._attend(query, key, value, key_padding_mask, need_weights, attn_mask,
                                    average_attn_weights, is_causal)
        if self.batch_first and is_batched:
            return out.transpose(1, 0), weights
        return out, weights

    def _attend(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal):
        """torch's F.multi_head_attention_forward with the projections as module calls (same checks and order)."""
        F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, self.num_heads)
        is_batched = query.dim() == 3
        if not is_batched:
            query, key, value = _same_identities(lambda x: x.unsqueeze(1), query, key, value)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        tgt_len, bsz, embed_dim = query.shape
        num_heads, head_dim = self.num_heads, self.head_dim
        if embed_dim != self.embed_dim:
            raise AssertionError(f"was expecting embedding dimension of {self.embed_dim}, but got {embed_dim}")
        key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                             other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                             target_type=query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                               "method `generate_square_subsequent_mask` to create this mask.")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # the is_causal hint alone tells scaled_dot_product_attention
        else:
            attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                          target_type=query.dtype, check_other=False)
            if key_padding_mask is not None:
                is_causal = False  # the merged mask is no longer causal
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        if attn_mask is not None and attn_mask.dim() == 2:
            attn_mask = attn_mask.unsqueeze(0)
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.repeat(1, bsz, 1).to(k.dtype)])
            v = torch.cat([v, self.bias_v.repeat(1, bsz, 1).to(v.dtype)])
            if attn_mask is not None:
                attn_mask = F.pad(attn_mask, (0, 1))
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, 1))
        q = q.reshape(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
        k = k.reshape(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
        v = v.reshape(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
        if self.add_zero_attn:
            zeros = (bsz * num_heads, 1, head_dim)
            k = torch.cat([k, torch.zeros(zeros, dtype=k.dtype, device=k.device)], dim=1)
            v = torch.cat([v, torch.zeros(zeros, dtype=v.dtype, device=v.device)], dim=1)
            if attn_mask is not None:
                attn_mask = F.pad(attn_mask, (0, 1))
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, 1))
        src_len = k.size(1)
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (bsz, src_len):
                raise AssertionError(f"expecting key_padding_mask shape of {(bsz, src_len)}, but got "
                                     f"{tuple(key_padding_mask.shape)}")
            key_padding_mask = (key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1)
                                .reshape(bsz * num_heads, 1, src_len))
            attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            if is_causal and attn_mask is None:
                raise AssertionError("is_causal is not implemented for need_weights without attn_mask")
            q_scaled = q * math.sqrt(1.0 / float(head_dim))
            if attn_mask is not None:
                scores = torch.baddbmm(attn_mask.to(q_scaled.dtype), q_scaled, k.transpose(-2, -1))
            else:
                scores = torch.bmm(q_scaled, k.transpose(-2, -1))
            weights = F.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
            out = self.out_proj(out).view(tgt_len, bsz, -1)
            weights = weights.view(bsz, num_heads, tgt_len, src_len)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not is_batched:
                out, weights = out.squeeze(1), weights.squeeze(0)
            return out, weights
        if attn_mask is not None:
            if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0)
            else:
                attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
        q = q.view(bsz, num_heads, tgt_len, head_dim)
        k = k.view(bsz, num_heads, src_len, head_dim)
        v = v.view(bsz, num_heads, src_len, head_dim)
        if attn_mask is not None:
            attn_mask = attn_mask.to(q.dtype) if attn_mask.is_floating_point() else attn_mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
        out = self.out_proj(out).view(tgt_len, bsz, -1)
        if not is_batched:
            out = out.squeeze(1)
        return out, None


def _same_identities(fn, query: Tensor, key: Tensor, value: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """fn applied to query, key and value, keeping which of them are the same tensor (self-attention: all three;
    encoder-decoder attention: key and value), as torch does: the projections that read one tensor read one tensor
    (conversion groups them by it, lightning_fp8/conversion/first_last.py)."""
    q = fn(query)
    k = q if key is query else fn(key)
    v = k if value is key else (q if value is query else fn(value))
    return q, k, v


@contextlib.contextmanager
def mha_fastpath_disabled() -> Iterator[None]:
    """torch's fused inference paths of nn.MultiheadAttention / TransformerEncoder(Layer) off for the block."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


class FastPathFree(nn.Module):
    """Mixed (first) into nn.TransformerEncoderLayer / nn.TransformerEncoder holding FP8 projections: runs the module
    path always, never torch's fused fast path (which reads the Parameters directly and would bypass FP8)."""

    def forward(self, *args, **kwargs):
        with mha_fastpath_disabled():
            return super().forward(*args, **kwargs)
