"""Where an Accelerator's explicit `mixed_precision` argument came from: the user, or a library's default.

Under an FP8 launch an explicit `mixed_precision=` argument wins, as in Accelerate. But transformers' `Trainer` passes
`mixed_precision=args.mixed_precision` to the Accelerator it builds whatever the user did, and some libraries turn a
precision on by default: trl's configs (`SFTConfig`, `DPOConfig`, ... through trl's `_BaseConfig`) declare
`bf16: bool | None = None` and resolve None to True. `trace` tells the two apart:

- the Trainer: the nearest caller frame whose `self` is a `transformers.Trainer` (any subclass: trl's trainers, the
  user's) holds the TrainingArguments the Accelerator was built from; it counts only if their `mixed_precision` is
  the value passed. Frames, not a patch of transformers: the Trainer builds `Accelerator(**args)` in its own method,
  so its `self` is on the stack at that moment in every version and subclass, and nothing of transformers changes.
- the user: a precision field (`bf16`, `fp16`) set on the command line the process was started with (`sys.argv`:
  `--bf16`, `--bf16 true`, `--bf16=True`, `--no_bf16`, as HfArgumentParser accepts them, with the `.args` file
  HfArgumentParser reads next to the script), or in a JSON / YAML options file named there (`--config sft.yaml`,
  `train.py args.json`), or set in code where the field's dataclass default is False (a value True then was set by
  someone on purpose).
- a library default: the field is True, its dataclass default is not False (None resolved by the library, or True),
  and the command line and the options files do not set it. Likewise mixed_precision "no" with bf16 and fp16 off:
  TrainingArguments built before FP8 was requested (`enable_fp8()` after them) read "no" from the environment then.

Limit: a value set in code on a field whose default is not False (`SFTConfig(bf16=True)`) cannot be told from the
library's default once the dataclass is built (both read True); it counts as the default, and the line said then names
the two ways to keep bf16 (`--bf16 true` on the command line, `--mixed_precision bf16` at launch).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Optional, Sequence

#: the precision fields of transformers' TrainingArguments, by the mixed precision each turns on
PRECISION_FIELDS = {"bf16": "bf16", "fp16": "fp16"}
#: option files HfArgumentParser-based scripts take on the command line (run_clm's `train.py args.json`, TrlParser's
#: `--config sft.yaml`)
_OPTION_FILE_SUFFIXES = (".json", ".yaml", ".yml")
#: the values HfArgumentParser's string_to_bool takes after a boolean flag (`--bf16 true`)
_BOOL_WORDS = ("true", "false", "yes", "no", "1", "0", "t", "f", "y", "n")
#: how far up the stack the Trainer is looked for (the Trainer's method is the Accelerator's direct caller; a few more
#: frames for an Accelerator subclass whose __init__ calls super().__init__)
_MAX_FRAMES = 64


@dataclass(frozen=True)
class PrecisionSource:
    """Who chose an explicit `mixed_precision`.

    value: the argument ("bf16", "fp16", "no"). library_default: True when a library chose it, not the user (FP8 may
    then win). args: the Trainer's TrainingArguments it came from, or None. field: the TrainingArguments field that
    turned it on ("bf16" / "fp16"), None for "no" or without a Trainer. why / fix: what the messages say (who chose
    it; how the user gets the other precision)."""

    value: str
    library_default: bool
    args: Optional[Any]
    field: Optional[str]
    why: str
    fix: str

    def fp8_wins_message(self) -> str:
        """The one line said when the launch's FP8 wins over this library default."""
        changed = f"args.{self.field} set to False, " if self.field else ""
        return (f"lightning_fp8: {self.why}: the launch's FP8 wins over a library default, so this run trains in FP8 "
                f"({changed}args.mixed_precision to 'fp8'). {self.fix}")

    def let_fp8_win(self) -> None:
        """Make the TrainingArguments say what runs: code that reads `args.bf16` after the Accelerator is built (trl's
        GRPO / RLOO trainers cast the model to bfloat16 for generation when it is True) must not act on a default
        that lost."""
        if self.args is None:
            return
        if self.field is not None:
            setattr(self.args, self.field, False)
        self.args.mixed_precision = "fp8"


def trace(value: Any, frame: Optional[FrameType], argv: Optional[Sequence[str]] = None) -> PrecisionSource:
    """Who chose `value`, the explicit `mixed_precision` an Accelerator is being built with.

    frame: the Accelerator's `__init__` frame (the Trainer is looked for above it). argv: the command line (default
    `sys.argv`, which HfArgumentParser reads)."""
    value = str(value).lower()
    argv = list(sys.argv if argv is None else argv)
    args = _trainer_arguments(value, frame)
    if args is None:
        return PrecisionSource(
            value, False, None, None,
            why=f"this Accelerator was built with mixed_precision={value!r} explicitly in the script",
            fix="Remove that argument to train in FP8.",
        )
    owner = _owner(args)
    if value == "no":
        if not getattr(args, "bf16", False) and not getattr(args, "fp16", False):
            return PrecisionSource(
                value, True, args, None,
                why=(f"{owner}, built before FP8 was requested, read mixed_precision 'no' from "
                     "ACCELERATE_MIXED_PRECISION then (bf16 and fp16 are off)"),
                fix="To train without FP8, leave out lightning_fp8.accelerate.enable_fp8().",
            )
        return _unexplained(value, owner, args)
    field = PRECISION_FIELDS.get(value)
    if field is None or getattr(args, field, None) is not True:
        return _unexplained(value, owner, args)
    typed = _given_on_command_line(field, argv)
    if typed is not None:
        return PrecisionSource(
            value, False, args, field,
            why=(f"this Accelerator was built with mixed_precision={value!r} explicitly (transformers' Trainer "
                 f"passes it from {owner}: {field}=True, from {typed})"),
            fix=f"Remove {typed} to train in FP8.",
        )
    default = _field_default(type(args), field)
    if default is False or default is dataclasses.MISSING:
        return PrecisionSource(
            value, False, args, field,
            why=(f"this Accelerator was built with mixed_precision={value!r} explicitly (transformers' Trainer "
                 f"passes it from {owner}: {field}=True, set in the script, whose field default is False; "
                 f"--{field} is not on the command line)"),
            fix=f"Set {field}=False in the script's {type(args).__name__} to train in FP8.",
        )
    resolved = ", resolved to True by the library" if default is None else ""
    return PrecisionSource(
        value, True, args, field,
        why=(f"{owner} turns {field} on by default (field default {default!r}{resolved}; --{field} is not on the "
             "command line)"),
        fix=f"To train in {value}, pass --{field} true on the command line or launch with --mixed_precision {value}.",
    )


def _unexplained(value: str, owner: str, args: Any) -> PrecisionSource:
    """A Trainer's value that no precision field explains (e.g. set on the TrainingArguments after they were built):
    the user's, as any explicit argument."""
    return PrecisionSource(
        value, False, args, None,
        why=(f"this Accelerator was built with mixed_precision={value!r} explicitly (transformers' Trainer passes "
             f"the mixed_precision of {owner})"),
        fix="Set the TrainingArguments' precision (bf16 / fp16 / mixed_precision) in the script to train in FP8.",
    )


def _trainer_arguments(value: str, frame: Optional[FrameType]) -> Optional[Any]:
    """The TrainingArguments of the transformers Trainer building this Accelerator (the nearest caller frame whose
    `self` is a Trainer), if their mixed_precision is `value`; else None."""
    trainer_module = sys.modules.get("transformers.trainer")  # no Trainer exists unless transformers loaded it
    trainer_class = getattr(trainer_module, "Trainer", None)
    if trainer_class is None:
        return None
    depth = 0
    while frame is not None and depth < _MAX_FRAMES:
        owner = frame.f_locals.get("self")
        if isinstance(owner, trainer_class):
            args = getattr(owner, "args", None)
            if args is not None and str(getattr(args, "mixed_precision", "")).lower() == value:
                return args
            return None
        frame, depth = frame.f_back, depth + 1
    return None


def _owner(args: Any) -> str:
    """"trl's SFTConfig", "transformers' TrainingArguments": the library whose class declares the arguments."""
    cls = type(args)
    library = cls.__module__.split(".")[0]
    return f"{library}'{'' if library.endswith('s') else 's'} {cls.__name__}"


def _field_default(cls: type, name: str) -> Any:
    """The dataclass default of field `name` of `cls` (dataclasses.MISSING if it has none or is no field)."""
    for field in dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ():
        if field.name == name:
            return field.default
    return dataclasses.MISSING


def _given_on_command_line(field: str, argv: Sequence[str]) -> Optional[str]:
    """Where the command line sets `field`, as the user typed it ("`--bf16 true` on the command line", "`--bf16` in
    train.args", "bf16 in sft.yaml"), or None.

    Reads what HfArgumentParser reads: the `.args` file next to the script, the arguments (up to a bare `--`), and the
    JSON / YAML options files named among them."""
    sources = []
    if argv and argv[0] and Path(argv[0]).name:  # no script name (an interactive session): no .args file
        args_file = Path(argv[0]).with_suffix(".args")
        if args_file.is_file():
            sources.append((f"in {args_file.name}", args_file.read_text().split()))
    sources.append(("on the command line", list(argv[1:])))
    names = {field, f"no_{field}"}
    for where, tokens in sources:
        for i, token in enumerate(tokens):
            if token == "--":
                break
            if token.startswith("--"):
                name, has_value, _ = token[2:].partition("=")
                if name.replace("-", "_") in names:
                    following = tokens[i + 1] if i + 1 < len(tokens) else ""
                    if not has_value and following.lower() in _BOOL_WORDS:
                        token = f"{token} {following}"
                    return f"`{token}` {where}"
            elif token.endswith(_OPTION_FILE_SUFFIXES) and field in _option_file_keys(token):
                return f"{field} in {token}"
    return None


def _option_file_keys(path: str) -> set:
    """The top-level keys of a JSON / YAML options file (empty if it is no such file or cannot be read)."""
    if not os.path.isfile(path):
        return set()
    try:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".json"):
                content = json.load(f)
            else:
                import yaml  # a dependency of transformers, whose Trainer is the only caller

                content = yaml.safe_load(f)
    except Exception:  # not an options file after all: it says nothing about the precision
        return set()
    return set(content) if isinstance(content, dict) else set()
