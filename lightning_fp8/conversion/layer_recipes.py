"""Per-layer recipes: a different FP8Recipe for the layers whose names match glob patterns.

    convert_to_fp8(model, FP8Recipe(), layer_recipes={"*.attn.*": FP8Recipe(scaling="rowwise")})

`layer_recipes` maps fnmatch patterns of fully qualified layer names to recipes, in order: the first pattern that
matches a layer gives its recipe, the model's recipe serves the others. A layer's effective recipe is then
`layer.recipe` (FP8LayerFallback's escalation may change it later). Which layers convert at all is decided by the
model's recipe and filter (first / last, skip_patterns): a per-layer recipe only says how a converted layer computes
(format, scaling, history, margin, rounding, backend).
"""
from __future__ import annotations

import fnmatch
import warnings
from typing import Iterable, Mapping, Optional, Sequence, Tuple, Union

from lightning_fp8.recipe import FP8Recipe

LayerRecipes = Union[Mapping[str, FP8Recipe], Sequence[Tuple[str, FP8Recipe]]]


def normalize_layer_recipes(layer_recipes: Optional[LayerRecipes]) -> Tuple[Tuple[str, FP8Recipe], ...]:
    """The (pattern, recipe) pairs in order, validated: a clear error for anything else."""
    if layer_recipes is None:
        return ()
    items = list(layer_recipes.items()) if isinstance(layer_recipes, Mapping) else list(layer_recipes)
    pairs = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(
                f"layer_recipes must map name patterns to FP8Recipe objects (a dict, or (pattern, recipe) pairs), got "
                f"the entry {item!r}"
            )
        pattern, recipe = item
        if not isinstance(pattern, str):
            raise TypeError(f"layer_recipes: a pattern must be a str (an fnmatch pattern of layer names), got {pattern!r}")
        if not isinstance(recipe, FP8Recipe):
            raise TypeError(f"layer_recipes[{pattern!r}] must be an FP8Recipe, got {type(recipe).__name__}")
        pairs.append((pattern, recipe))
    return tuple(pairs)


def recipe_for(fqn: str, default: FP8Recipe, layer_recipes: Tuple[Tuple[str, FP8Recipe], ...]) -> FP8Recipe:
    """The recipe of layer `fqn`: the first matching pattern's, else `default`."""
    for pattern, recipe in layer_recipes:
        if fnmatch.fnmatchcase(fqn, pattern):
            return recipe
    return default


def warn_unmatched(layer_recipes: Tuple[Tuple[str, FP8Recipe], ...], converted: Iterable[str]) -> None:
    """A pattern that matched no converted layer is most likely a typo: say so."""
    names = list(converted)
    for pattern, _ in layer_recipes:
        if not any(fnmatch.fnmatchcase(fqn, pattern) for fqn in names):
            warnings.warn(f"lightning_fp8: layer_recipes pattern {pattern!r} matches no converted layer "
                          f"(converted: {names[:5]}{' ...' if len(names) > 5 else ''})", UserWarning, stacklevel=3)
