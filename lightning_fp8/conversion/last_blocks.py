"""The last blocks rule: the linear layers of a model's last repeated blocks stay in BF16.

`FP8Recipe.keep_last_blocks_in_bf16` (0.15 for scaling="nvfp4", 0 otherwise): the fraction of the model's repeated
blocks, counted from the end, whose linear layers the default filter keeps in BF16, rounded to the nearest number of
blocks (half up). Why: 4-bit training loses the most in the last layers, which shape the logits; NVIDIA's and
torchtitan's NVFP4 recipes keep the last ~15% of the blocks (and the output head, which the first / last rule keeps
already) in BF16, which is what lets NVFP4 training track BF16.

"The repeated blocks" are the children of the model's longest `nn.ModuleList` (or `nn.Sequential`) whose children
contain linear layers: a transformer's `layers` / `h` / `blocks`. A model without one has no blocks, and the rule
keeps nothing.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

from lightning_fp8.recipe import FP8Recipe

SWITCH = "recipe.keep_last_blocks_in_bf16"


def repeated_blocks(model: nn.Module, candidates: Sequence[str]) -> Optional[Tuple[str, List[str]]]:
    """(prefix of the block container, the prefix of each block in order) for the container with the most blocks that
    hold candidate layers; None without one."""
    best: Optional[Tuple[str, List[str]]] = None
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        prefix = f"{fqn}." if fqn else ""
        blocks = [f"{prefix}{name}" for name in module._modules]
        holding = [b for b in blocks if any(c == b or c.startswith(b + ".") for c in candidates)]
        if len(holding) >= 2 and (best is None or len(holding) > len(best[1])):
            best = (fqn, holding)
    return best


def last_block_reasons(model: nn.Module, candidates: Sequence[str], recipe: FP8Recipe) -> Dict[str, str]:
    """{fqn: why it stays in BF16} for the candidate layers inside the model's last blocks (module docstring)."""
    fraction = recipe.keep_last_blocks_in_bf16
    if not fraction or not candidates:
        return {}
    found = repeated_blocks(model, candidates)
    if found is None:
        return {}
    container, blocks = found
    count = min(len(blocks), math.floor(fraction * len(blocks) + 0.5))
    if count == 0:
        return {}
    kept = blocks[-count:]
    why = (f"in the last {count} of {len(blocks)} blocks of {container or 'the model'} ({SWITCH}={fraction:g}"
           f"{', the scope of ' + recipe.scaling if recipe.scaling == 'nvfp4' else ''})")
    return {c: f"{why}: kept in BF16" for c in candidates if any(c == b or c.startswith(b + ".") for b in kept)}
