"""The FP8 state of a converted model, saved and loaded on its own.

FP8 layers keep their metadata (scales, amax histories, counters, the precision switch) out of `state_dict()`, so a
converted model's state_dict has exactly the keys of the original model: it loads into an unconverted model, and
exports such as Hugging Face's `save_pretrained` stay clean. The metadata travels separately:

    meta = fp8_state_dict(model)          # {"<layer>.fp8_meta.<role>.<buffer>": tensor, ...}
    load_fp8_state_dict(model, meta)      # into a model converted the same way

Every adapter's checkpoint carries it (Lightning: the plugin's checkpoint entry; Fabric: the plugin's state_dict;
Accelerate: the registered engine state), as do rollback snapshots. Plain PyTorch users save it next to the model's
state_dict. Without it a converted model starts its scaling afresh (current scaling on its first step), which is safe.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict

import torch
from torch import nn

from lightning_fp8.conversion.convert import fp8_layers
from lightning_fp8.state_format import format_version, stamped

#: marks the FP8 metadata entries of a state dict ("<layer fqn>.fp8_meta.<role>.<buffer>")
FP8_META_MARKER = ".fp8_meta."


#: the format version of `fp8_state_dict` (lightning_fp8/state_format.py), recorded as torch records module versions:
#: in the returned OrderedDict's `_metadata` (not an entry, so the mapping stays tensors only, keyed like a state_dict)
FP8_STATE_VERSION = 1


def fp8_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The FP8 metadata of every FP8 layer of `model`, keyed like a state_dict (detached tensors, not copies)."""
    state: Dict[str, torch.Tensor] = OrderedDict()
    for fqn, layer in fp8_layers(model).items():
        prefix = f"{fqn}.fp8_meta." if fqn else "fp8_meta."
        state.update(layer.fp8_meta.state_dict(prefix=prefix, keep_vars=False))
    state._metadata = {"": stamped({}, FP8_STATE_VERSION)}  # type: ignore[attr-defined]
    return state


def load_fp8_state_dict(model: nn.Module, state: Dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load what `fp8_state_dict` returned into `model` (converted the same way), in place.

    strict: an entry for a layer that is not an FP8 layer of this model is an error (a checkpoint of a differently
    converted model); FP8 layers without entries keep their current state either way."""
    format_version(getattr(state, "_metadata", {}).get("", {}), "FP8 layer state (fp8_state_dict)", FP8_STATE_VERSION)
    layers = fp8_layers(model)
    unexpected = []
    by_layer: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        fqn, marker, rest = _split(key)
        if not marker or fqn not in layers:
            unexpected.append(key)
            continue
        by_layer.setdefault(fqn, {})[rest] = value
    if unexpected and strict:
        raise RuntimeError(
            "lightning_fp8: the checkpoint holds FP8 metadata for layers this model does not have in FP8: "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    for fqn, entries in by_layer.items():
        layers[fqn].fp8_meta.load_state_dict(entries, strict=False)
        layers[fqn].sync_precision_flag()


def split_fp8_meta(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Remove FP8 metadata entries from a model state_dict in place and return them (an older checkpoint's model
    state_dict holds them)."""
    keys = [k for k in state_dict if FP8_META_MARKER in f".{k}"]
    return {k: state_dict.pop(k) for k in keys}


def _split(key: str):
    if key.startswith("fp8_meta."):
        return "", True, key[len("fp8_meta."):]
    fqn, marker, rest = key.partition(FP8_META_MARKER)
    return fqn, bool(marker), rest
