"""FP8 layers built before conversion decided them, and how conversion decides them.

Inside a plugin's `module_init_context` (Lightning's configure_model, Fabric's init_module) `nn.Linear(...)` builds an
FP8Linear marked undecided (`BUILT_UNDECIDED_ATTR`: integrations/linear_builder.py), because which layers stay in
BF16 is not known while the model is being built (the first / last rule needs the whole model, a module_filter the
layer's name). The next conversion call decides them with the same rules as any layer (`plan_conversion`, which
reads each as the plain layer it stands for):

- a model no one sharded yet: the undecided layers become plain layers again (`give_back_plain_layers`) and the
  model converts as any other, with every rule (a traced forward for first / last where an example input exists);
- a model sharded inside the hook (FSDP2 or tensor parallelism): layers cannot be replaced any more, so each keeps its
  FP8 class and takes the decision `plan_undecided` makes for it (first / last from the module order: a traced
  forward would run the sharded model's collectives); the caller switches the ones kept in BF16 off.
"""
from __future__ import annotations

from typing import Dict, Optional

from torch import nn

from lightning_fp8.conversion import transplant
from lightning_fp8.conversion.convert import BUILT_UNDECIDED_ATTR, fp8_layers, plan_conversion
from lightning_fp8.conversion.filters import ModuleFilter
from lightning_fp8.conversion.first_last import NoTrace
from lightning_fp8.modules.linear import FP8Layer
from lightning_fp8.recipe import FP8Recipe


def undecided_layers(model: nn.Module) -> Dict[str, FP8Layer]:
    """The FP8 layers of `model` built before conversion decided them, by fully qualified name."""
    return {fqn: m for fqn, m in fp8_layers(model).items() if BUILT_UNDECIDED_ATTR in m.__dict__}


def plan_undecided(model: nn.Module, recipe: FP8Recipe, module_filter: Optional[ModuleFilter], layer_recipes,
                   why_untraced: str) -> Dict[str, Optional[str]]:
    """{fqn: None (FP8) or the reason to stay in BF16} of the undecided layers of a sharded model: the conversion
    rules, first / last from the module order (`why_untraced` says why no forward is traced)."""
    pending = undecided_layers(model)
    plan = plan_conversion(model, recipe, module_filter, example_input=NoTrace(why_untraced),
                           layer_recipes=layer_recipes)
    return {fqn: plan.get(fqn) for fqn in pending}


def give_back_plain_layers(model: nn.Module, pending: Dict[str, FP8Layer]) -> None:
    """The undecided layers of a model no one sharded become plain layers again (same Parameters), for the
    conversion that follows to decide as any other."""
    parents = transplant.parent_index(model)
    for layer in pending.values():
        transplant.replace_everywhere(parents, layer, transplant.to_unconverted(layer))


def decided(layer: FP8Layer) -> None:
    """`layer` has its decision: it is no longer undecided."""
    layer.__dict__.pop(BUILT_UNDECIDED_ATTR, None)
