"""`python -m lightning_fp8.litgpt COMMAND ... --precision fp8`: litgpt's own command line, training in FP8.

litgpt (Lightning's LLM library) builds its own `lightning.Fabric(precision=...)` in every command and offers no way
to hand it a precision plugin; its parser takes only Lightning's precision strings ("bf16-mixed", ...) and Lightning's
precision strings are a closed set. This entry runs litgpt's CLI unchanged (same commands, flags, config files) with
three additions:

- `--precision fp8` (or `fp8-mixed`) is taken by this entry: litgpt's parser is handed the precision of everything
  that is not an FP8 GEMM instead ("bf16-mixed": the plugin's BF16 autocast around float32 weights; "16-mixed" with
  `--fp8.compute_dtype fp16`), so litgpt's own checks and the `hyperparameters.yaml` it writes see a precision litgpt
  knows, and a checkpoint written in FP8 loads in plain litgpt.
- While the command runs, every `lightning.Fabric` it builds (`pretrain`'s, `finetune_lora`'s and the `merge_lora`
  that ends it, ...) carries a new `lightning_fp8.fabric.FP8Precision` in place of the precision string
  (`fp8_fabrics`), and the checkpoints it saves with `fabric.save` carry the plugin's state (FP8 scales, amax
  histories, loss scaler), which litgpt's `--resume` then restores; a gradient clip litgpt asks for without
  `error_if_nonfinite` leaves a non-finite norm to the plugin (the step is skipped) instead of raising; the patch is
  undone when the command returns.
- `--fp8.<option> VALUE` sets an option of `FP8Precision` (`--fp8.recipe.scaling current`, `--fp8.loss_scaling
  dynamic`, `--fp8.recipe auto`; `--fp8.help` lists them), parsed from the plugin's own signature.

Processes that litgpt's Fabric launches itself (several devices without torchrun) re-run the command line litgpt
parsed, which holds no `--precision fp8` any more: the options travel to them in the environment variable
`LIGHTNING_FP8_LITGPT_OPTIONS`, which this entry sets for the run.

Without `--precision fp8` nothing is patched: the command is litgpt's as it is. Where `requests` is not installed
(litgpt's CLI asks jsonargparse for URL config files, which need it, and huggingface_hub >= 1 no longer brings it),
the CLI runs with URL config files off instead of failing, and says so.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch

#: the values of `--precision` that mean FP8 (neither litgpt's parser nor Lightning knows them)
FP8_PRECISIONS = ("fp8", "fp8-mixed")
#: the precision litgpt is handed instead, by the plugin's compute dtype: what everything but the FP8 GEMMs computes in
LITGPT_PRECISION = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}
#: the prefix of the command-line options that configure the plugin (`--fp8.loss_scaling dynamic`)
OPTION_PREFIX = "--fp8."
#: the entry of a Fabric checkpoint that holds the FP8 plugin's state (`fp8_fabrics`)
CHECKPOINT_KEY = "lightning_fp8"
#: carries the `--fp8.*` options (a JSON list of command-line tokens) to the processes litgpt's Fabric launches
ENV_OPTIONS = "LIGHTNING_FP8_LITGPT_OPTIONS"
#: how this entry is run, for messages
PROG = "python -m lightning_fp8.litgpt"


@dataclass
class LitGPTCommand:
    """A command line split in two: what litgpt's CLI parses, and the plugins to build (None: not an FP8 run)."""

    litgpt_argv: List[str]
    fp8_argv: Optional[List[str]] = None
    plugins: Optional["PluginFactory"] = None


def parse_command_line(argv: Sequence[str], environ: Optional[dict] = None) -> LitGPTCommand:
    """Split `argv`: `--precision fp8` / `fp8-mixed` (`--precision X` or `--precision=X`) and every
    `--fp8.<option> VALUE` / `--fp8.<option>=VALUE` are this entry's, the rest is litgpt's, in order, with the FP8
    precision replaced by the precision litgpt is handed (`LITGPT_PRECISION`). Without `--precision fp8` on the command
    line, `environ[ENV_OPTIONS]` (set by the process that launched this one) makes it an FP8 run with those options.

    Raises SystemExit with a message naming the fix: `--fp8.*` options without `--precision fp8`, `--precision` given
    twice with and without fp8, an option without a value, an option the plugin does not have or a value it refuses."""
    environ = os.environ if environ is None else environ
    litgpt_argv: List[str] = []
    fp8_argv: List[str] = []
    precisions: List[str] = []
    fp8_slots: List[int] = []  # where litgpt's --precision value goes, once the compute dtype is known
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith(OPTION_PREFIX):
            if "=" in token or token == OPTION_PREFIX + "help":
                fp8_argv.append(token)
            elif i + 1 < len(tokens):
                fp8_argv += [token, tokens[i + 1]]
                i += 1
            else:
                raise SystemExit(f"{PROG}: {token} needs a value ({token} VALUE or {token}=VALUE)")
            i += 1
            continue
        if token == "--precision" and i + 1 < len(tokens):
            prefix, value, i = "", tokens[i + 1], i + 2
            litgpt_argv.append(token)
        elif token.startswith("--precision="):
            prefix, value, i = "--precision=", token.split("=", 1)[1], i + 1
        else:
            litgpt_argv.append(token)
            i += 1
            continue
        precisions.append(value)
        if value in FP8_PRECISIONS:
            fp8_slots.append(len(litgpt_argv))
        litgpt_argv.append(prefix + value)
    if OPTION_PREFIX + "help" in fp8_argv:
        option_parser().print_help()
        raise SystemExit(0)
    if fp8_slots and precisions[-1] not in FP8_PRECISIONS or not fp8_slots and fp8_argv:
        raise SystemExit(f"{PROG}: the {OPTION_PREFIX}* options configure FP8 training: pass --precision fp8 once "
                         f"(the FP8 precisions: {', '.join(FP8_PRECISIONS)}; got --precision "
                         f"{', '.join(precisions) or 'none'}{' and ' + ' '.join(fp8_argv) if fp8_argv else ''})")
    if not fp8_slots:
        if ENV_OPTIONS not in environ:
            return LitGPTCommand(litgpt_argv)
        fp8_argv = json.loads(environ[ENV_OPTIONS])
    plugins = PluginFactory(fp8_argv)
    litgpt_precision = LITGPT_PRECISION[plugins.compute_dtype]
    for slot in fp8_slots:
        prefix = "--precision=" if litgpt_argv[slot].startswith("--precision=") else ""
        litgpt_argv[slot] = prefix + litgpt_precision
    return LitGPTCommand(litgpt_argv, fp8_argv, plugins)


def option_parser() -> Any:
    """The parser of the `--fp8.*` options: one option per argument of `lightning_fp8.fabric.FP8Precision`, with its
    type and documentation (jsonargparse, which litgpt's CLI is built on)."""
    from jsonargparse import ArgumentParser

    from lightning_fp8.integrations.fabric_plugin import FP8Precision

    parser = ArgumentParser(prog=f"{PROG} COMMAND ... --precision fp8", exit_on_error=False,
                            description="Options of lightning_fp8.fabric.FP8Precision, for --precision fp8.")
    parser.add_class_arguments(FP8Precision, "fp8")
    return parser


class PluginFactory:
    """Builds a new FP8Precision from the parsed `--fp8.*` options at each call (one per Fabric). Construction builds
    one at once, so a value the plugin refuses stops the command before litgpt starts."""

    def __init__(self, fp8_argv: Sequence[str]) -> None:
        parser = option_parser()
        try:
            self._config = parser.parse_args(list(fp8_argv))
        except Exception as error:  # jsonargparse's ArgumentError: which option, and why
            raise SystemExit(f"{PROG}: {error} ({OPTION_PREFIX}help lists the options)") from None
        self._instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
        try:
            first = self()
        except ValueError as error:  # the plugin's own validation names the valid choices
            raise SystemExit(f"{PROG}: {error}") from None
        self.compute_dtype = first.compute_dtype

    def __call__(self) -> Any:
        return self._instantiate(copy.deepcopy(self._config)).fp8


@contextlib.contextmanager
def fp8_fabrics(make_plugin: Callable[[], Any]) -> Iterator[List[Any]]:
    """While active, every `lightning.Fabric(...)` built (in any module: litgpt builds its own) carries
    `make_plugin()` as its precision plugin, and its checkpoints carry the plugin's state; restored on exit.

    - A `precision=` string the Fabric is given is dropped (Fabric refuses a string and a plugin together). A Fabric
      given another precision plugin (litgpt's `--quantize`: bitsandbytes) raises ValueError: FP8 layers and
      quantized layers do not combine; so does one given Fabric's FSDPStrategy (FSDP1, what litgpt's `pretrain` picks
      for several devices), which FP8 layers do not support (FSDP2, `ModelParallelStrategy`, is supported).
    - `fabric.clip_gradients(...)` without `error_if_nonfinite` does not raise on a non-finite gradient norm: the
      plugin's engine skips that step instead (litgpt's `pretrain` leaves Fabric's default, which would end the run
      at the first FP8 overflow). An explicit `error_if_nonfinite=True` is kept.
    - `fabric.save(path, state)` adds the plugin under `CHECKPOINT_KEY` (loss scaler, counters, every FP8 layer's
      scales and amax histories, which the model's state_dict leaves out) unless `state` holds it already, and
      `fabric.load(path, state)` restores it from there; a checkpoint without that entry (written without FP8) loads
      as before. So litgpt's own `--resume` resumes the FP8 scaling state too.

    Yields the list of the plugins built, in order."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import Precision
    from lightning.fabric.strategies import FSDPStrategy
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    originals = {name: getattr(Fabric, name) for name in ("__init__", "save", "load", "clip_gradients")}
    built: List[Any] = []

    def carries_plugin(fabric: Any) -> bool:
        return any(fabric.strategy.precision is plugin for plugin in built)

    @functools.wraps(originals["__init__"])
    def __init__(self: Any, *args: Any, precision: Any = None, plugins: Any = None, **kwargs: Any) -> None:
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        others = [plugin for plugin in plugins if isinstance(plugin, Precision)]
        if others:
            raise ValueError(f"lightning_fp8: --precision fp8 cannot run with the precision plugin "
                             f"{type(others[0]).__name__} (litgpt's --quantize): drop one of them")
        strategy = kwargs.get("strategy")
        if isinstance(strategy, FSDPStrategy) or (isinstance(strategy, str) and strategy.startswith("fsdp")):
            raise ValueError("lightning_fp8: --precision fp8 does not support Fabric's FSDPStrategy (FSDP1), which "
                             "litgpt's pretrain uses on several devices: run it on one device (--devices 1), or use a "
                             "command that shards with FSDP2 (ModelParallelStrategy: finetune_lora)")
        plugin = make_plugin()
        built.append(plugin)
        if precision is not None:
            rank_zero_info(f"lightning_fp8.litgpt: Fabric(precision={precision!r}) runs with FP8Precision: FP8 GEMMs, "
                           f"{LITGPT_PRECISION[plugin.compute_dtype]} around them")
        originals["__init__"](self, *args, plugins=[*plugins, plugin], **kwargs)

    def own_plugin(fabric: Any, state: Any) -> Optional[Any]:
        """The fabric's FP8 plugin when `state` (a dict) should carry it under CHECKPOINT_KEY, else None."""
        if not isinstance(state, dict) or not carries_plugin(fabric) or CHECKPOINT_KEY in state:
            return None
        plugin = fabric.strategy.precision
        return None if any(value is plugin for value in state.values()) else plugin

    @functools.wraps(originals["save"])
    def save(self: Any, path: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
        plugin = own_plugin(self, state)
        if plugin is None:
            return originals["save"](self, path, state, *args, **kwargs)
        state[CHECKPOINT_KEY] = plugin  # in the caller's dict, removed after: Fabric reads it, litgpt never sees it
        try:
            return originals["save"](self, path, state, *args, **kwargs)
        finally:
            state.pop(CHECKPOINT_KEY, None)

    @functools.wraps(originals["load"])
    def load(self: Any, path: Any, state: Any = None, *args: Any, **kwargs: Any) -> Any:
        plugin = own_plugin(self, state)
        if plugin is None or not state:
            return originals["load"](self, path, state, *args, **kwargs)
        # in the caller's dict, last: Fabric writes the loaded plain values (litgpt's iter_num) back into that dict,
        # and names the first requested key the checkpoint lacks, so a KeyError naming this one means only it is
        # missing (a checkpoint written without FP8)
        state[CHECKPOINT_KEY] = plugin
        try:
            return originals["load"](self, path, state, *args, **kwargs)
        except KeyError as error:
            if f"'{CHECKPOINT_KEY}'" not in str(error):
                raise
        finally:
            state.pop(CHECKPOINT_KEY, None)
        return originals["load"](self, path, state, *args, **kwargs)

    @functools.wraps(originals["clip_gradients"])
    def clip_gradients(self: Any, module: Any, optimizer: Any, clip_val: Any = None, max_norm: Any = None,
                       norm_type: Any = 2.0, error_if_nonfinite: Optional[bool] = None) -> Any:
        if error_if_nonfinite is None:
            error_if_nonfinite = not carries_plugin(self)
        return originals["clip_gradients"](self, module, optimizer, clip_val, max_norm, norm_type, error_if_nonfinite)

    patched = {"__init__": __init__, "save": save, "load": load, "clip_gradients": clip_gradients}
    for name, function in patched.items():
        setattr(Fabric, name, function)
    try:
        yield built
    finally:
        for name, function in originals.items():
            setattr(Fabric, name, function)


@contextlib.contextmanager
def _config_files_readable(litgpt_cli: Any) -> Iterator[None]:
    """litgpt's CLI turns on URL config files (in `litgpt.__main__` and again in `litgpt.utils.CLI`, which saves
    hyperparameters.yaml), which jsonargparse refuses without `requests`: without it, the CLI runs with them off (local
    config files work) and one line says so."""
    if importlib.util.find_spec("requests") is not None:
        yield
        return
    import jsonargparse

    original = jsonargparse.set_config_read_mode
    said = []

    @functools.wraps(original)
    def set_config_read_mode(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("urls_enabled") and not said:
            said.append(True)
            print(f"{PROG}: `requests` is not installed: litgpt's --config cannot read URLs (pip install requests)",
                  file=sys.stderr)
        kwargs["urls_enabled"] = False
        return original(*args, **kwargs)

    jsonargparse.set_config_read_mode = litgpt_cli.set_config_read_mode = set_config_read_mode
    try:
        yield
    finally:
        jsonargparse.set_config_read_mode = litgpt_cli.set_config_read_mode = original


def main(argv: Optional[Sequence[str]] = None) -> List[Any]:
    """Run litgpt's CLI (`litgpt COMMAND ...`) on `argv` (default: sys.argv[1:]), in FP8 with `--precision fp8`.

    Returns the FP8Precision plugins the command's Fabrics carried, in the order they were built (empty without FP8):
    each holds the model it set up (`plugin._module`) and its engine, for a caller that runs litgpt in process."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = parse_command_line(argv)
    try:
        import litgpt.__main__ as litgpt_cli
    except ImportError as error:  # litgpt, or a package its commands import
        raise SystemExit(f"{PROG}: litgpt's command line cannot be imported ({error}); beside transformers 5: "
                         "pip install --no-deps litgpt==0.5.13 and the packages its commands import (docs/models.md, "
                         "'litgpt')") from None

    saved_argv, saved_env = sys.argv, os.environ.get(ENV_OPTIONS)
    # litgpt parses sys.argv (and again when it saves hyperparameters.yaml); Lightning's launcher re-runs
    # `sys.argv[0]` / this module with sys.argv[1:] in each process it starts
    sys.argv = [saved_argv[0] if saved_argv else PROG, *command.litgpt_argv]
    try:
        with _config_files_readable(litgpt_cli):
            if command.plugins is None:
                litgpt_cli.main()
                return []
            os.environ[ENV_OPTIONS] = json.dumps(command.fp8_argv)
            with fp8_fabrics(command.plugins) as plugins:
                litgpt_cli.main()
            return plugins
    finally:
        sys.argv = saved_argv
        if saved_env is None:
            os.environ.pop(ENV_OPTIONS, None)
        else:
            os.environ[ENV_OPTIONS] = saved_env
