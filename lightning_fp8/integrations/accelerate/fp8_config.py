"""Accelerate's FP8 configuration (`fp8_config:` of an accelerate config file, the launcher's `--fp8_*` flags), read
for lightning_fp8's engine: what maps onto its options is honoured, the rest is named in one warning.

How the settings reach a training process: `accelerate launch` copies the config file's `fp8_config` keys (and the
`--fp8_*` flags) to `args.fp8_<key>` and exports each as an environment variable `ACCELERATE_FP8_<KEY>`
(`accelerate/utils/launcher.py`, `setup_fp8_env`); Accelerate's own `TERecipeKwargs` / `FP8RecipeKwargs` /
`AORecipeKwargs` / `MSAMPRecipeKwargs` read them back in the process (`accelerate/utils/dataclasses.py`). Accelerate's
launcher exports *every* `--fp8_*` flag, its defaults included (`FORMAT=HYBRID`, `AMAX_HISTORY_LEN=1024`, ...), so a
process cannot tell a value the user chose from a default; `python -m lightning_fp8.accelerate launch` therefore
exports only the fields the config file or the command line gave (`explicit_fp8_args`, called by launcher.py), and
everything `ACCELERATE_FP8_*` in a process is then something someone asked for.

The mapping (`read_launch_config`):

    fp8_format (E4M3, E5M2, HYBRID)          FP8Recipe.format ("e4m3", "e5m2", "hybrid")
    amax_history_len                         FP8Recipe.amax_history_len
    amax_compute_algo (max, most_recent)     FP8Recipe.amax_compute_algo
    margin                                   FP8Recipe.margin
    use_mxfp8_block_scaling                  True: FP8Recipe.scaling="mxfp8" (1x32 E8M0 block scales, TE's MXFP8)
    override_linear_precision (F, D, W)      wgrad True: FP8Recipe.weight_grad="high_precision"; fprop / dgrad True:
                                             ignored (no such per-GEMM switch here)
    use_autocast_during_eval                 FP8Kwargs.fp8_eval (FP8 in eval-mode forwards)
    enable_fsdp_float8_all_gather            FP8Kwargs.fp8_all_gather
    interval                                 1 is what the engine does (scales updated every step); other values
                                             ignored
    pad_inner_dim                            False is what conversion does (unaligned layers stay in BF16); True
                                             ignored
    backend (TE, MSAMP, AO), opt_level       ignored: they choose and configure Accelerate's own backends, and
                                             lightning_fp8 runs the FP8 here

The recipe is the default one (`FP8Recipe()`) with those fields replaced. An `FP8Kwargs` given to the Accelerator (or
to `enable_fp8`) wins over all of it: the config is then not applied, and a warning says so.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

from lightning_fp8.recipe import FP8Recipe

ENV_PREFIX = "ACCELERATE_FP8_"
#: the `fp8_config` fields Accelerate 1.15 knows, as (field name, environment variable suffix)
FIELDS: Tuple[Tuple[str, str], ...] = (
    ("backend", "BACKEND"),
    ("fp8_format", "FORMAT"),
    ("amax_history_len", "AMAX_HISTORY_LEN"),
    ("amax_compute_algo", "AMAX_COMPUTE_ALGO"),
    ("margin", "MARGIN"),
    ("interval", "INTERVAL"),
    ("use_autocast_during_eval", "USE_AUTOCAST_DURING_EVAL"),
    ("override_fprop", "OVERRIDE_FPROP"),
    ("override_dgrad", "OVERRIDE_DGRAD"),
    ("override_wgrad", "OVERRIDE_WGRAD"),
    ("use_mxfp8_block_scaling", "USE_MXFP8_BLOCK_SCALING"),
    ("opt_level", "OPT_LEVEL"),
    ("enable_fsdp_float8_all_gather", "ENABLE_FSDP_FLOAT8_ALL_GATHER"),
    ("pad_inner_dim", "PAD_INNER_DIM"),
)
#: the recipe fields fp8_config can set (the honoured message names the defaults of those it does not give)
MAPPED_RECIPE_FIELDS = ("format", "amax_history_len", "amax_compute_algo", "margin")
#: Accelerate's format names -> FP8Recipe.format
FORMATS = {"E4M3": "e4m3", "E5M2": "e5m2", "HYBRID": "hybrid"}
_TRUE = ("1", "true", "yes", "y", "on", "t")
_FALSE = ("0", "false", "no", "n", "off", "f")
#: what was said in this process (each message once, whatever the number of Accelerators built)
_said: Set[str] = set()


@dataclass(frozen=True)
class LaunchFP8Config:
    """The fp8_config of this process (from `ACCELERATE_FP8_*`), translated.

    given: {field: value as set}; recipe: FP8Recipe fields; options: FP8Kwargs fields; honoured: "field=value ->
    what it sets" lines; ignored: "field=value (why)" lines."""

    given: Dict[str, str]
    recipe: Dict[str, Any] = field(default_factory=dict)
    options: Dict[str, Any] = field(default_factory=dict)
    honoured: List[str] = field(default_factory=list)
    ignored: List[str] = field(default_factory=list)

    def kwargs(self):
        """The FP8Kwargs these settings amount to (the default recipe with the mapped fields replaced)."""
        from lightning_fp8.integrations.accelerate.kwargs import FP8Kwargs

        return FP8Kwargs(recipe=FP8Recipe(**self.recipe), **self.options)

    def honoured_message(self) -> str:
        defaults = FP8Recipe()
        rest = [f"{name}={getattr(defaults, name)!r}" for name in MAPPED_RECIPE_FIELDS if name not in self.recipe]
        tail = f" Not given, so lightning_fp8's defaults: {', '.join(rest)}." if rest else ""
        return ("lightning_fp8: FP8 settings from the launch's fp8_config (ACCELERATE_FP8_* variables): "
                + "; ".join(self.honoured) + "." + tail)

    def ignored_message(self) -> str:
        return ("lightning_fp8: fp8_config settings with no equivalent in lightning_fp8 are ignored: "
                + "; ".join(self.ignored) + ".")

    def overridden_message(self) -> str:
        names = ", ".join(f"{name}={value}" for name, value in self.given.items())
        return (f"lightning_fp8: the launch's fp8_config ({names}) is not applied: FP8Kwargs were given (to the "
                "Accelerator or to enable_fp8()), and explicit FP8Kwargs win over the launch configuration. Put "
                "those settings in the FP8Kwargs (recipe=FP8Recipe(...)) to use them.")


def given_settings(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """{fp8_config field: value} of the `ACCELERATE_FP8_*` variables set in `environ` (default: this process's)."""
    environ = os.environ if environ is None else environ
    return {name: environ[ENV_PREFIX + suffix] for name, suffix in FIELDS if ENV_PREFIX + suffix in environ}


def read_launch_config(environ: Optional[Mapping[str, str]] = None) -> Optional[LaunchFP8Config]:
    """The launch's fp8_config translated for lightning_fp8 (see the module docstring), or None when none is set.
    Invalid values raise ValueError naming the variable and the valid choices."""
    given = given_settings(environ)
    if not given:
        return None
    config = LaunchFP8Config(given)
    recipe, options, honoured, ignored = config.recipe, config.options, config.honoured, config.ignored

    if "fp8_format" in given:
        value = given["fp8_format"].strip().upper()
        if value not in FORMATS:
            raise ValueError(_invalid("fp8_format", given["fp8_format"], list(FORMATS)))
        recipe["format"] = FORMATS[value]
        honoured.append(f"fp8_format={given['fp8_format']} -> format={FORMATS[value]!r}")
    if "amax_history_len" in given:
        recipe["amax_history_len"] = _int("amax_history_len", given["amax_history_len"], minimum=1)
        honoured.append(f"amax_history_len={recipe['amax_history_len']}")
    if "amax_compute_algo" in given:
        value = given["amax_compute_algo"].strip().lower()
        if value not in ("max", "most_recent"):
            raise ValueError(_invalid("amax_compute_algo", given["amax_compute_algo"], ["max", "most_recent"]))
        recipe["amax_compute_algo"] = value
        honoured.append(f"amax_compute_algo={value}")
    if "margin" in given:
        recipe["margin"] = _int("margin", given["margin"], minimum=0)
        honoured.append(f"margin={recipe['margin']}")
    if "use_mxfp8_block_scaling" in given:
        if _flag("use_mxfp8_block_scaling", given["use_mxfp8_block_scaling"]):
            recipe["scaling"] = "mxfp8"
            honoured.append("use_mxfp8_block_scaling=True -> scaling='mxfp8'")
        else:
            honoured.append("use_mxfp8_block_scaling=False (per-tensor delayed scaling, the default)")
    overrides = {gemm: _flag(f"override_{gemm}", given[f"override_{gemm}"])
                 for gemm in ("fprop", "dgrad", "wgrad") if f"override_{gemm}" in given}
    if overrides:
        if overrides.get("wgrad"):
            recipe["weight_grad"] = "high_precision"
            honoured.append("override_linear_precision wgrad=True -> weight_grad='high_precision'")
        high = [gemm for gemm in ("fprop", "dgrad") if overrides.get(gemm)]
        if high:
            ignored.append(f"override_linear_precision {', '.join(g + '=True' for g in high)} (no per-GEMM switch for "
                           "the forward / input-gradient GEMM: keep a layer in BF16 with FP8Recipe(skip_patterns=...) "
                           "or module_filter instead)")
        if not any(overrides.values()):
            honoured.append("override_linear_precision=(False, False, False) (every GEMM in FP8, as here)")
    if "use_autocast_during_eval" in given:
        options["fp8_eval"] = _flag("use_autocast_during_eval", given["use_autocast_during_eval"])
        honoured.append(f"use_autocast_during_eval={options['fp8_eval']} -> fp8_eval={options['fp8_eval']}")
    if "enable_fsdp_float8_all_gather" in given:
        options["fp8_all_gather"] = _flag("enable_fsdp_float8_all_gather", given["enable_fsdp_float8_all_gather"])
        honoured.append(f"enable_fsdp_float8_all_gather={options['fp8_all_gather']} -> "
                        f"fp8_all_gather={options['fp8_all_gather']}")
    if "interval" in given:
        interval = _int("interval", given["interval"], minimum=1)
        if interval == 1:
            honoured.append("interval=1 (scales updated every step, as here)")
        else:
            ignored.append(f"interval={interval} (lightning_fp8 updates the scales after every step)")
    if "pad_inner_dim" in given:
        if _flag("pad_inner_dim", given["pad_inner_dim"]):
            ignored.append("pad_inner_dim=True (lightning_fp8 does not pad: layers whose dimensions are not "
                           "multiples of 16 stay in BF16, see precision_map(model))")
        else:
            honoured.append("pad_inner_dim=False (no padding, as here)")
    if "backend" in given:
        ignored.append(f"backend={given['backend']} (it chooses one of Accelerate's own FP8 backends; under "
                       "`python -m lightning_fp8.accelerate launch` and enable_fp8() lightning_fp8's engine runs FP8. "
                       "FP8Kwargs(backend='transformer_engine') runs Transformer Engine's te.Linear under that engine)")
    if "opt_level" in given:
        ignored.append(f"opt_level={given['opt_level']} (MS-AMP's optimization level)")
    try:
        FP8Recipe(**recipe)
    except ValueError as error:
        raise ValueError(f"lightning_fp8: the launch's fp8_config does not make a valid recipe: {error}") from None
    return config


def say_once(message: str, warn: bool) -> None:
    """Warn (UserWarning) or log at INFO on rank zero, once per process for each message."""
    if message in _said:
        return
    _said.add(message)
    from lightning_fp8.integrations import _rank_zero

    if warn:
        _rank_zero.rank_zero_warn(message)
    else:
        _rank_zero.rank_zero_info(message)


def explicit_fp8_args(args: Any, defaults: Any) -> Set[str]:
    """The launcher's `fp8_*` arguments the user gave: on the command line (Accelerate's parser records them in
    `args.nondefault`) or in the config file's `fp8_config` (the launcher copies those onto `args` as `fp8_<key>`)."""
    explicit = {name for name in getattr(args, "nondefault", ()) or () if name.startswith("fp8_")}
    config = getattr(defaults, "fp8_config", None) if defaults is not None else None
    for key in config or {}:
        explicit.add(key if key.startswith("fp8") else f"fp8_{key}")
    return explicit


def keep_explicit_fp8_args(args: Any, defaults: Any) -> None:
    """Set every `fp8_*` launcher argument the user did not give to None, so the launch exports only the
    `ACCELERATE_FP8_*` variables someone asked for (Accelerate's `setup_fp8_env` skips None values; its own FP8
    handlers fall back to the same defaults the flags have)."""
    explicit = explicit_fp8_args(args, defaults)
    for name in list(vars(args)):
        if name.startswith("fp8_") and name not in explicit:
            setattr(args, name, None)


def _invalid(name: str, value: str, choices: List[str]) -> str:
    return (f"lightning_fp8: fp8_config {name}={value!r} ({ENV_PREFIX}{dict(FIELDS)[name]}) is not valid; valid "
            f"choices: {choices}")


def _int(name: str, value: str, minimum: int) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"lightning_fp8: fp8_config {name}={value!r} ({ENV_PREFIX}{dict(FIELDS)[name]}) must be an "
                         f"integer >= {minimum}")
    return number


def _flag(name: str, value: str) -> bool:
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(_invalid(name, value, ["True", "False"]))


def _reset_said() -> None:
    """Forget what was said (tests)."""
    _said.clear()
