"""Short layer names for the report (the full name stays on hover).

Hugging Face and Lightning names repeat long prefixes (`model.model.layers.17.self_attn.q_proj`). The short name
drops the dotted prefix every layer shares (but never down to a bare index), then everything before the container
of the first block index (`layers.17.self_attn.q_proj`), then, if still longer than `max_len`, the middle. Names
that would collide keep their longer form.
"""
from __future__ import annotations

from typing import Dict, List, Sequence


def _common_prefix(parts: List[List[str]]) -> int:
    if len(parts) < 2:
        return 0
    n = 0
    for column in zip(*parts):
        if len(set(column)) != 1:
            break
        n += 1
    return min(n, min(len(p) for p in parts) - 1)  # keep at least the last component


def _from_block(parts: List[str]) -> List[str]:
    for i, part in enumerate(parts):
        if part.isdigit():
            return parts[max(0, i - 1):]
    return parts


def _elide(name: str, max_len: int) -> str:
    if len(name) <= max_len:
        return name
    keep = max_len - 1
    head = keep // 3
    return name[:head] + "\u2026" + name[len(name) - (keep - head):]


def short_names(fqns: Sequence[str], max_len: int = 30) -> Dict[str, str]:
    """{full name: short name} for a set of layer names (see the module docstring)."""
    split = [f.split(".") for f in fqns]
    cut = _common_prefix(split)
    while cut > 0 and any(p[cut].isdigit() for p in split):  # "net.2" stays "net.2", not "2"
        cut -= 1
    stages = [
        lambda p: ".".join(p[cut:]),
        lambda p: _elide(".".join(_from_block(p[cut:])), max_len),
    ]
    out = {f: stages[0](p) for f, p in zip(fqns, split)}
    candidate = {f: stages[1](p) for f, p in zip(fqns, split)}
    counts: Dict[str, int] = {}
    for short in candidate.values():
        counts[short] = counts.get(short, 0) + 1
    for f, short in candidate.items():
        if counts[short] == 1:
            out[f] = short
    return out
