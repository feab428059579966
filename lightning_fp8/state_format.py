"""The format version every state lightning_fp8 saves carries, and the rule that reads it.

Version 0 is the format of a state that records no version (such states load unchanged); each state records the
version it was written in, and a reader refuses a version newer than it knows, naming both, instead of misreading it.
Saved states hold tensors and plain containers only, so `torch.load(weights_only=True)` reads them.
"""
from __future__ import annotations

from typing import Any, Dict, MutableMapping

#: the key of the version in a saved dict
FORMAT_VERSION_KEY = "format_version"


def stamped(state: MutableMapping[str, Any], version: int) -> MutableMapping[str, Any]:
    """`state` with its format version recorded (in place)."""
    state[FORMAT_VERSION_KEY] = version
    return state


def format_version(state: Dict[str, Any], what: str, newest: int) -> int:
    """The format version of a saved `state` (0 where it records none). Raises ValueError for a version newer than
    `newest`, the newest this code reads; `what` names the state in that message."""
    version = int(state.get(FORMAT_VERSION_KEY, 0))
    if version > newest:
        raise ValueError(f"lightning_fp8: this {what} was saved in format version {version} by a newer lightning_fp8; "
                         f"this one reads versions up to {newest}. Upgrade lightning_fp8 to load it.")
    return version
