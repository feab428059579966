"""Which linear layers are "first" and "last": the order the forward runs them in, and siblings that share an input.

The first/last rule (`FP8Recipe.keep_first_last_in_bf16`) keeps both ends of the network in BF16. It counts only
layers that would otherwise convert (a layer already kept in BF16 for another reason is never "first" or "last"), and
it treats layers that read the same input tensor as one group:

- **first**: the first linear layer the forward runs, and every layer that reads the same input tensor (a
  transformer's layer-0 q, k and v projections; a SwiGLU MLP's gate and up projections if they came first);
- **last**: the last linear layer the forward runs, and every layer that reads the same input as it.

How the order and the groups are found:

- **traced** (when an example input is known): one forward of the model with a pre-hook on every candidate layer
  recording the input tensor it receives. It runs on the meta device when the model allows (no compute, no memory,
  no state change); otherwise as a real forward in eval mode under `torch.no_grad()`, with the RNG state restored.
  Layers the traced forward does not run are never first or last. Example inputs come from, in this order: the
  `example_input` argument of `convert_to_fp8` / `precision_map`; a LightningModule's `example_input_array`; a
  Hugging Face model's own (`dummy_inputs`, or a `pixel_values` image of the config's size for vision models, 224
  where the config has none, as convolutional models' configs do). A
  model without one is searched for Hugging Face submodules, which are traced on their own.
- **module order** (no example input, or the forward failed): the order the layers were registered in; the reason in
  the precision map says so. Without a trace, siblings known to read the same input are grouped all the same
  (`sibling_groups`): the q, k and v projections of one attention, by their names (`q` / `k` / `v`, `q_proj` /
  `k_proj` / `v_proj`, `wq` / `wk` / `wv`, `query` / `key` / `value`, `to_q` / ..., any names under one parent that
  differ only in that token), a gated MLP's `gate_proj` / `up_proj`, and nn.MultiheadAttention's input projections
  (conversion/torch_transformer.py knows which of them share the input). A group stands where its first layer is registered
  for "first", and where its last one is for "last".

"Last" is the group of the last layer in forward (or module) order, whatever position the group's first layer has.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_map

#: `example_input` value meaning "look for one on the model"
AUTO = "auto"
#: the image size of a Hugging Face vision model's example input when its config has none
VISION_DEFAULT_SIZE = 224


class NoTrace(NamedTuple):
    """An example input that says no forward may run (a sharded model, whose forward would run collectives): the
    module order decides, `why` saying so in the reasons."""

    why: str


class ExampleCall(NamedTuple):
    """A real call's positional and keyword arguments, as an example input (the adapters' first forward)."""

    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class LayerOrder:
    """Candidate layers grouped by shared input, in forward order. `method`: how that order was found.

    order: every layer in forward (or module) order, one entry each; `first()` / `last()` are the groups of its first
    and last layer. shared: {layer: how it is known to share its group's input} for groups found without a trace."""

    groups: List[List[str]]
    method: str  # "traced" or "module order"
    note: str = ""  # why the module order was used
    order: List[str] = field(default_factory=list)
    shared: Dict[str, str] = field(default_factory=dict)

    def _group_of(self, fqn: Optional[str]) -> List[str]:
        return next((group for group in self.groups if fqn in group), [])

    def first_layer(self) -> Optional[str]:
        return self.order[0] if self.order else (self.groups[0][0] if self.groups else None)

    def last_layer(self) -> Optional[str]:
        return self.order[-1] if self.order else (self.groups[-1][-1] if self.groups else None)

    def first(self) -> List[str]:
        return self._group_of(self.first_layer())

    def last(self) -> List[str]:
        return self._group_of(self.last_layer())


def layer_order(model: nn.Module, candidates: List[str], example_input: Any = AUTO) -> LayerOrder:
    """Group `candidates` (fully qualified names of layers of `model`, in module order) as described above."""
    if not candidates:
        return LayerOrder([], "module order")
    if isinstance(example_input, NoTrace):
        return module_order(model, candidates, example_input.why)
    scopes = _scopes(model, example_input)
    traced: Dict[str, Tuple[List[List[str]], List[str]]] = {}
    failures = []
    for prefix, scope, inputs in scopes:
        inside = [fqn for fqn in candidates if _under(fqn, prefix)]
        try:
            traced[prefix] = _trace(model if not prefix else scope, prefix, inside, inputs)
        except Exception as error:  # a forward that cannot run on an example input: fall back to module order
            failures.append(f"{prefix or 'the model'}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    untraced = [fqn for fqn in candidates if not any(_under(fqn, p) for p in traced)]
    if failures:
        note = "the example forward failed (" + "; ".join(failures) + ")"
    elif not scopes:
        note = "no example input to trace the forward (pass example_input, or set example_input_array)"
    else:
        note = "layers outside the traced Hugging Face model"
    if not traced:
        return module_order(model, candidates, note)
    siblings, shared = sibling_groups(model, untraced)
    groups: List[List[str]] = []
    order: List[str] = []
    emitted = set()
    for fqn in candidates:
        prefix = next((p for p in traced if _under(fqn, p)), None)
        if prefix is None:
            order.append(fqn)
            group = siblings.get(fqn, [fqn])
            if group[0] == fqn:  # a sibling group stands where its first layer is registered
                groups.append(list(group))
        elif prefix not in emitted:
            emitted.add(prefix)
            groups.extend(traced[prefix][0])
            order.extend(traced[prefix][1])
    if not untraced:
        return LayerOrder(groups, "traced", order=order)
    return LayerOrder(groups, "partly traced", note, order=order, shared=shared)


def module_order(model: nn.Module, candidates: List[str], note: str) -> LayerOrder:
    """First / last without a trace: the order the layers were registered in, a guess, corrected where the model's
    structure says otherwise, with the siblings known to read one input grouped (`sibling_groups`).

    The correction: an output head (`output_heads`: the layer projecting onto the vocabulary of an embedding table)
    reads what the model computes last, wherever it is registered (litgpt's GPT registers `lm_head` before its
    blocks), so it moves to the end of the order. `note` says why no trace was made; the LayerOrder's note adds the
    correction, so the reasons of the layers it decides say what was guessed and what was known."""
    heads = output_heads(model, candidates)
    ordered = [fqn for fqn in candidates if fqn not in heads] + [fqn for fqn in candidates if fqn in heads]
    siblings, shared = sibling_groups(model, ordered)
    groups = [list(siblings.get(fqn, [fqn])) for fqn in ordered if siblings.get(fqn, [fqn])[0] == fqn]
    if heads and ordered != list(candidates):
        note += "; " + "; ".join(f"{fqn} counted last: {why}" for fqn, why in heads.items())
    return LayerOrder(groups, "module order", note, order=ordered, shared=shared)


def output_heads(model: nn.Module, names: List[str]) -> Dict[str, str]:
    """The layers among `names` that project onto the vocabulary of one of the model's embedding tables, {fqn: why}:
    a weight that is the table itself (tied), or that has its shape (vocabulary x width) outside the model's repeated
    blocks (a layer inside an nn.ModuleList / nn.ModuleDict is a block's, whatever its shape). A model's output
    head, whatever its name and registration order."""
    tables = [(fqn, m.weight) for fqn, m in model.named_modules()
              if isinstance(m, nn.Embedding) and m.num_embeddings > 1 and isinstance(m.weight, torch.Tensor)]
    in_blocks = {fqn for container_fqn, container in model.named_modules()
                 if isinstance(container, (nn.ModuleList, nn.ModuleDict))
                 for fqn in names if _under(fqn, container_fqn) and fqn != container_fqn}
    heads: Dict[str, str] = {}
    for fqn in names:
        weight = getattr(model.get_submodule(fqn), "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        for table_fqn, table in tables:
            if weight is table:
                heads[fqn] = f"its weight is the embedding table {table_fqn} (tied): it projects onto the vocabulary"
                break
            if tuple(weight.shape) == tuple(table.shape) and fqn not in in_blocks:
                heads[fqn] = (f"its weight has the shape of the embedding table {table_fqn} "
                              f"({table.shape[0]} x {table.shape[1]}) outside the repeated blocks: it projects onto "
                              "the vocabulary")
                break
    return heads


# -- siblings that read the same input, without a trace -----------------------------------------------------------
#: role tokens of layers that read one input: an attention's q / k / v projections, a gated MLP's gate / up
ROLE_FAMILIES: Tuple[Tuple[str, ...], ...] = (
    ("q", "k", "v"),
    ("query", "key", "value"),
    ("wq", "wk", "wv"),
    ("gate", "up"),
)
_ROLE_OF = {token: (i, family) for i, family in enumerate(ROLE_FAMILIES) for token in family}
_FAMILY_NOTE = {
    0: "the q / k / v projections of one attention, by name",
    1: "the query / key / value projections of one attention, by name",
    2: "the wq / wk / wv projections of one attention, by name",
    3: "the gate and up projections of one gated MLP, by name",
}


def sibling_groups(model: nn.Module, names: List[str]) -> Tuple[Dict[str, List[str]], Dict[str, str]]:
    """Layers among `names` (in module order) known to read the same input without tracing a forward: ({layer: its
    group, in module order} for every layer in a group of two or more, {layer: how the sharing is known}).

    - nn.MultiheadAttention's projections: as conversion/torch_transformer.py says (`shared_input_projections`);
    - siblings (one parent) whose names differ only in a role token of one family of ROLE_FAMILIES: `q_proj` /
      `k_proj` / `v_proj`, `wq` / `wk` / `wv`, `query` / `key` / `value`, `to_q` / `to_k` / `to_v`, `gate_proj` /
      `up_proj`. A name holding two role tokens (a fused `query_key_value`) is a layer of its own.
    Names say what a layer is meant to read; a cross-attention's k and v read another tensor than its q, which only a
    traced forward sees (such a block is neither first nor last in the models seen so far)."""
    from lightning_fp8.conversion.torch_transformer import shared_input_projections
    from lightning_fp8.modules.multihead_attention import ProjectedMultiheadAttention

    wanted = set(names)
    groups: List[List[str]] = []
    notes: Dict[str, str] = {}
    for group in shared_input_projections(model):
        members = [fqn for fqn in group if fqn in wanted]
        if len(members) > 1:
            groups.append(members)
            notes.update({fqn: "the input projections of one nn.MultiheadAttention" for fqn in members})
    by_key: Dict[Tuple, List[str]] = {}
    for fqn in names:
        parent, _, leaf = fqn.rpartition(".")
        if isinstance(model.get_submodule(parent) if parent else model, ProjectedMultiheadAttention):
            continue  # an nn.MultiheadAttention's projections: torch_transformer.py said which share the input
        tokens = leaf.lower().split("_")
        roles = [(i, token) for i, token in enumerate(tokens) if token in _ROLE_OF]
        if len(roles) != 1:
            continue
        position, token = roles[0]
        family = _ROLE_OF[token][0]
        template = tuple(tokens[:position]) + ("{}",) + tuple(tokens[position + 1:])
        by_key.setdefault((parent, family, template), []).append(fqn)
    for (_, family, _), members in by_key.items():
        roles = {_leaf_role(fqn) for fqn in members}
        if len(members) > 1 and len(roles) == len(members):
            groups.append(members)
            notes.update({fqn: _FAMILY_NOTE[family] for fqn in members})
    position = {fqn: i for i, fqn in enumerate(names)}
    index: Dict[str, List[str]] = {}
    for group in groups:
        ordered = sorted(group, key=position.__getitem__)
        index.update({fqn: ordered for fqn in ordered})
    return index, notes


def _leaf_role(fqn: str) -> str:
    tokens = fqn.rpartition(".")[2].lower().split("_")
    return next(token for token in tokens if token in _ROLE_OF)


# -- example inputs -----------------------------------------------------------------------------------------------
def _scopes(model: nn.Module, example_input: Any) -> List[Tuple[str, nn.Module, Any]]:
    """(prefix, module, inputs) to trace: the model itself, or its top-most Hugging Face submodules."""
    if example_input is not AUTO and example_input is not None:
        return [("", model, example_input)]
    found = _own_example_input(model)
    if found is not None:
        return [("", model, found)]
    scopes: List[Tuple[str, nn.Module, Any]] = []
    for fqn, module in model.named_modules():
        if not fqn or any(_under(fqn, p) for p, _, _ in scopes):
            continue
        inputs = _hf_example_input(module)
        if inputs is not None:
            scopes.append((fqn, module, inputs))
    return scopes


def _own_example_input(module: nn.Module) -> Any:
    lightning_input = getattr(module, "example_input_array", None)  # LightningModule's convention
    if lightning_input is not None:
        return lightning_input
    return _hf_example_input(module)


def _hf_example_input(module: nn.Module) -> Optional[Dict[str, torch.Tensor]]:
    """A Hugging Face model's example input, built from its config (no transformers import here)."""
    config = getattr(module, "config", None)
    main = getattr(module, "main_input_name", None)
    if config is None or not isinstance(main, str) or not hasattr(type(module), "dummy_inputs"):
        return None
    if main == "pixel_values":
        # convolutional models (ResNet, ConvNeXt) take any size and have no image_size: 224, their pretraining size
        size = getattr(config, "image_size", VISION_DEFAULT_SIZE)
        channels = getattr(config, "num_channels", 3)
        if isinstance(size, (list, tuple)):
            size = size[0]
        if not isinstance(size, int):
            return None
        return {"pixel_values": torch.zeros(1, channels, size, size)}
    try:
        inputs = dict(module.dummy_inputs)
    except Exception:
        return None
    if main not in inputs:
        return None
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" not in inputs and "input_ids" in inputs:
        inputs["decoder_input_ids"] = inputs["input_ids"]
    return inputs


# -- tracing ------------------------------------------------------------------------------------------------------
def _trace(root: nn.Module, prefix: str, candidates: List[str], inputs: Any) -> Tuple[List[List[str]], List[str]]:
    """Run `root` on `inputs` (meta device first, else a real eval-mode no_grad forward) and group the candidates
    by the input tensor they receive, in the order they first run; also returns that order."""
    local = {fqn: fqn[len(prefix) + 1:] if prefix else fqn for fqn in candidates}
    calls: List[Tuple[str, torch.Tensor]] = []

    def recorder(fqn: str):
        def hook(module, args, kwargs):
            if not any(name == fqn for name, _ in calls):
                x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
                calls.append((fqn, x))  # the tensor is kept alive, so its identity is unique during the trace

        return hook

    handles = [
        root.get_submodule(name).register_forward_pre_hook(recorder(fqn), with_kwargs=True, prepend=True)
        for fqn, name in local.items()
    ]
    try:
        with warnings.catch_warnings(), _tensor_attributes_restored(root):
            warnings.simplefilter("ignore")
            try:
                _run_on_meta(root, inputs)
            except Exception:
                calls.clear()
                _run_for_real(root, inputs)
    finally:
        for handle in handles:
            handle.remove()
    groups: List[List[str]] = []
    inputs_seen: List[torch.Tensor] = []
    for fqn, x in calls:
        index = next((i for i, seen in enumerate(inputs_seen) if seen is x and x is not None), None)
        if index is None:
            inputs_seen.append(x)
            groups.append([fqn])
        else:
            groups[index].append(fqn)
    return groups, [fqn for fqn, _ in calls]


@contextlib.contextmanager
def _tensor_attributes_restored(root: nn.Module) -> Iterator[None]:
    """Put back tensors that forward code stores as plain attributes (the hook-based weight_norm / spectral_norm
    recompute `module.weight` that way, caches do too) and the buffers and parameters it registers on first use
    (litgpt's LoRA layer registers an index buffer on its weight's device), so a traced forward leaves no meta tensor
    behind."""
    saved = [(m, {k: v for k, v in m.__dict__.items() if isinstance(v, torch.Tensor)}, dict(m._buffers),
              set(m._non_persistent_buffers_set), dict(m._parameters)) for m in root.modules()]
    try:
        yield
    finally:
        for module, tensors, buffers, non_persistent, parameters in saved:
            for key in [k for k, v in module.__dict__.items() if isinstance(v, torch.Tensor) and k not in tensors]:
                del module.__dict__[key]
            module.__dict__.update(tensors)
            if module._buffers.keys() != buffers.keys():
                module._buffers.clear()
                module._buffers.update(buffers)
                module._non_persistent_buffers_set.clear()
                module._non_persistent_buffers_set.update(non_persistent)
            if module._parameters.keys() != parameters.keys():
                module._parameters.clear()
                module._parameters.update(parameters)


def _call(root: nn.Module, inputs: Any, call=None):
    call = call or root
    if isinstance(inputs, ExampleCall):
        return call(*inputs.args, **inputs.kwargs)
    if isinstance(inputs, dict):
        return call(**inputs)
    if isinstance(inputs, (tuple, list)):
        return call(*inputs)
    return call(inputs)


def _to(device):
    return lambda t: t.to(device) if isinstance(t, torch.Tensor) else t


def _run_on_meta(root: nn.Module, inputs: Any) -> None:
    from torch.func import functional_call

    state = {name: torch.empty_like(t, device="meta") for name, t in root.named_parameters(remove_duplicate=False)}
    state.update({name: torch.empty_like(t, device="meta") for name, t in root.named_buffers(remove_duplicate=False)})
    meta_inputs = tree_map(_to("meta"), inputs)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        _call(root, meta_inputs, lambda *a, **k: functional_call(root, state, a, k, tie_weights=True, strict=False))


def _run_for_real(root: nn.Module, inputs: Any) -> None:
    tensor = next(iter(root.parameters()), None)
    if tensor is None:
        tensor = next(iter(root.buffers()), None)
    if tensor is not None and tensor.device.type == "meta":
        raise RuntimeError("the model is on the meta device and its forward cannot run there")
    device = tensor.device if tensor is not None else torch.device("cpu")
    modes = [(m, m.training) for m in root.modules()]
    rng_devices = [device] if device.type == "cuda" else []
    try:
        for m, _ in modes:
            m.training = False
        with torch.random.fork_rng(devices=rng_devices), torch.no_grad():
            _call(root, tree_map(_to(device), inputs))
    finally:
        for m, mode in modes:
            m.training = mode


def _under(fqn: str, prefix: str) -> bool:
    return not prefix or fqn == prefix or fqn.startswith(prefix + ".")
