"""The char-GPT laid out for tensor parallelism, and its parallelization plan.

demo/gpt.py's GPT fuses q, k and v into one linear and takes its head count from the whole model width; tensor
parallelism splits attention by heads, each rank holding a slice of q, k and v. So this variant keeps q, k and v
apart, puts each block's attention and MLP in submodules (a PrepareModuleInput needs a module whose input is the
normalized activation) and counts heads from the width it receives. Same configuration (`GPTConfig`), same
initialisation rule, same loss; unparallelized it is an ordinary model.

    model = ParallelGPT(cfg)
    parallelize_gpt(model, tp_mesh)                       # FP8 styles, sequence parallel (the default)
    parallelize_gpt(model, tp_mesh, fp8_styles=False)     # torch's own styles: high-precision communication
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_fp8.demo.gpt import GPT, GPTConfig


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        # under tensor parallelism each rank computes its slice of the heads: the width it gets tells how many
        q, k, v = (lin(x).reshape(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(att.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelGPT(GPT):
    """demo/gpt.py's GPT (embeddings, head, initialisation, loss) with the blocks above."""

    block_class = Block


def tensor_parallel_plan(model: ParallelGPT, *, fp8_styles: bool = True, sequence_parallel: bool = True) -> dict:
    """The `parallelize_module` plan of `model` (Megatron-LM's layout): q, k, v and fc1 column-wise, proj and fc2
    row-wise; with sequence_parallel the LayerNorms run on sequence slices, attention's input is all-gathered once for
    q, k and v (PrepareFP8ModuleInput), fc1's by its own style. The embeddings and the head stay replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from lightning_fp8.distributed import FP8ColwiseParallel, FP8RowwiseParallel, PrepareFP8ModuleInput

    colwise, rowwise, prepare = ((FP8ColwiseParallel, FP8RowwiseParallel, PrepareFP8ModuleInput) if fp8_styles
                                 else (ColwiseParallel, RowwiseParallel, PrepareModuleInput))
    plan = {}
    for i in range(len(model.blocks)):
        block = f"blocks.{i}"
        plan.update({f"{block}.attn.q": colwise(), f"{block}.attn.k": colwise(), f"{block}.attn.v": colwise()})
        if sequence_parallel:
            plan.update({
                f"{block}.ln1": SequenceParallel(),
                f"{block}.attn": prepare(input_layouts=Shard(1), desired_input_layouts=Replicate()),
                f"{block}.attn.proj": rowwise(output_layouts=Shard(1)),
                f"{block}.ln2": SequenceParallel(),
                f"{block}.mlp.fc1": colwise(input_layouts=Shard(1)),
                f"{block}.mlp.fc2": rowwise(output_layouts=Shard(1)),
            })
        else:
            plan.update({f"{block}.attn.proj": rowwise(), f"{block}.mlp.fc1": colwise(), f"{block}.mlp.fc2": rowwise()})
    if sequence_parallel:
        plan.update({
            # the embeddings' sum enters the sequence-parallel region sliced, and the head reads the whole sequence
            "blocks.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True),
            "ln_f": SequenceParallel(),
            "head": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True),
        })
    return plan


def parallelize_gpt(model: ParallelGPT, tp_mesh, *, fp8_styles: bool = True, sequence_parallel: bool = True) -> ParallelGPT:
    """Apply `tensor_parallel_plan` over the 1-D tensor-parallel mesh `tp_mesh`; returns the model."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, tensor_parallel_plan(model, fp8_styles=fp8_styles,
                                                            sequence_parallel=sequence_parallel))
    return model
