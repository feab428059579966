"""Transformer Engine's own code on a CPU, without Transformer Engine installed.

`transformer_engine` cannot be installed next to the test suite: the package needs CUDA to import, and peft (imported
by transformers' Trainer) and Accelerate import it as soon as they find it. So the tests use a copy of the pinned
release's pure-Python parts, kept under tests/data/transformer_engine_<version>/ (see its NOTICE):

- `recipe.py`: `transformer_engine/common/recipe/__init__.py`, byte for byte (its hash is checked against the wheel's
  RECORD line, copied next to it). `load_recipe_module()` loads it by path under a private module name, so the
  backend's mapping is tested against TE's real recipe classes (pydantic dataclasses with TE's own validation) while
  no other package can import `transformer_engine`.
- `pytorch_api.py`: excerpts of `transformer_engine/pytorch/`: the signatures of `te.autocast`, `te.fp8_autocast` and
  `te.Linear` (bodies elided), and the delayed-scaling scale update (`_compute_scaling_factor`,
  `_default_sf_compute`, verbatim) that FP8Recipe(power_of_2_scales=True) plugs a function into.
  `pytorch_stand_in()` builds the stand-in for the part that needs TE's CUDA extension (te.Linear, te.autocast): it
  accepts exactly the calls TE's signatures accept, and computes in high precision.

Run as a script to write those files again from the wheel (`pip download transformer-engine==2.20.2 --no-deps`):

    python tests/support/te_source.py transformer_engine-2.20.2-py3-none-any.whl            # write
    python tests/support/te_source.py transformer_engine-2.20.2-py3-none-any.whl --check    # compare, write nothing
"""
from __future__ import annotations

import ast
import base64
import hashlib
import importlib.util
import inspect
import os
import sys
import types
import zipfile
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

#: the Transformer Engine release the copies come from (lightning_fp8.backends.te_recipes.TESTED_TE_VERSION)
TE_VERSION = "2.20.2"
DATA_DIR = Path(__file__).resolve().parent.parent / "data" / f"transformer_engine_{TE_VERSION}"

#: the files of the wheel the copies are made from, by where they land
RECIPE_SOURCE = "transformer_engine/common/recipe/__init__.py"
LICENSE_SOURCE = f"transformer_engine-{TE_VERSION}.dist-info/licenses/LICENSE"
RECORD_SOURCE = f"transformer_engine-{TE_VERSION}.dist-info/RECORD"
QUANTIZATION_SOURCE = "transformer_engine/pytorch/quantization.py"
LINEAR_SOURCE = "transformer_engine/pytorch/module/linear.py"

#: what pytorch_api.py holds: (source file, class or None, function, whole body or the signature only)
API_EXCERPTS: Tuple[Tuple[str, Optional[str], str, bool], ...] = (
    (QUANTIZATION_SOURCE, "autocast", "__init__", False),
    (QUANTIZATION_SOURCE, None, "fp8_autocast", False),
    (QUANTIZATION_SOURCE, None, "_default_sf_compute", True),
    (QUANTIZATION_SOURCE, None, "_compute_scaling_factor", True),
    (LINEAR_SOURCE, "Linear", "__init__", False),
)

_loaded: Dict[str, types.ModuleType] = {}


# -- loading the copies ----------------------------------------------------------------------------------------------
def _load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pydantic resolves the dataclasses' annotations through sys.modules[cls.__module__]
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_recipe_module(environ: Optional[Mapping[str, str]] = None) -> types.ModuleType:
    """TE's `transformer_engine.common.recipe`, loaded from the copy under a private name (never as
    `transformer_engine...`). The module reads environment variables (NVTE_*) for some defaults when its classes are
    defined: `environ` sets them for this load only (a fresh module, not cached); without it, the module is loaded
    once with every NVTE_* variable unset."""
    if environ is None and "default" in _loaded:
        return _loaded["default"]
    saved = {k: v for k, v in os.environ.items() if k.startswith("NVTE_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(environ or {})
    try:
        suffix = "" if environ is None else f"_env{len(_loaded)}"
        module = _load(DATA_DIR / "recipe.py", f"_lightning_fp8_tests_te_{TE_VERSION.replace('.', '_')}_recipe{suffix}")
    finally:
        for k in environ or {}:
            os.environ.pop(k, None)
        os.environ.update(saved)
    _loaded["default" if environ is None else module.__name__] = module
    return module


def load_api_excerpts() -> types.ModuleType:
    """pytorch_api.py: TE's te.autocast / te.fp8_autocast / te.Linear signatures and its delayed-scaling scale
    update."""
    if "api" not in _loaded:
        _loaded["api"] = _load(DATA_DIR / "pytorch_api.py", f"_lightning_fp8_tests_te_{TE_VERSION.replace('.', '_')}_api")
    return _loaded["api"]


def record_hash(path: Path) -> str:
    """A file's hash as a wheel's RECORD writes it: sha256=<urlsafe base64, no padding>."""
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def recorded_hashes() -> Dict[str, str]:
    """{path in the wheel: sha256=...} from the RECORD lines copied with the files."""
    rows = (line.split(",") for line in (DATA_DIR / "RECORD").read_text().splitlines() if line)
    return {path: digest for path, digest, _size in rows}


# -- the stand-in for transformer_engine.pytorch --------------------------------------------------------------------
def pytorch_stand_in(recipe_module: types.ModuleType) -> types.SimpleNamespace:
    """A stand-in for `transformer_engine.pytorch` (what needs TE's CUDA extension: te.Linear, te.autocast) whose
    constructors take exactly TE's parameters (`inspect.signature` of each is TE's; a call TE would refuse raises
    TypeError here), with the real `recipe_module` beside it. te.Linear computes in high precision and records, per
    forward, whether te.autocast was on and with which recipe (`calls`). Returned as a namespace: `pytorch` (the
    module to hand to the backend), `Linear`, `autocast`, `calls`, `state`."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    api = load_api_excerpts()
    autocast_signature = inspect.signature(api.autocast.__init__)
    linear_signature = inspect.signature(api.Linear.__init__)
    state = {"enabled": False, "recipe": None}
    calls: List[Tuple[bool, object]] = []

    class autocast:  # noqa: N801  (TE's name)
        def __init__(self, *args, **kwargs):
            bound = autocast_signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            self.enabled, self.recipe = bound.arguments["enabled"], bound.arguments["recipe"]

        def __enter__(self):
            if self.enabled and not isinstance(self.recipe, (type(None), recipe_module.Recipe)):
                raise TypeError(f"te.autocast(recipe=...) takes a transformer_engine recipe, got {self.recipe!r}")
            self.saved = dict(state)
            state.update(enabled=self.enabled, recipe=self.recipe)
            return self

        def __exit__(self, *exc):
            state.update(self.saved)
            return False

    autocast.__init__.__signature__ = autocast_signature

    class Linear(nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()
            bound = linear_signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            self.in_features, self.out_features = a["in_features"], a["out_features"]
            dtype = a["params_dtype"] if a["params_dtype"] is not None else torch.get_default_dtype()
            self.weight = nn.Parameter(torch.empty(a["out_features"], a["in_features"], dtype=dtype, device=a["device"]))
            self.bias = nn.Parameter(torch.zeros(a["out_features"], dtype=dtype, device=a["device"])) if a["bias"] else None
            nn.init.normal_(self.weight, std=0.02)

        def forward(self, x):
            calls.append((state["enabled"], state["recipe"]))
            return F.linear(x, self.weight, self.bias)

    Linear.__init__.__signature__ = linear_signature
    Linear.__module__ = "transformer_engine.pytorch.module.linear"
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.Linear, pytorch.autocast = Linear, autocast
    return types.SimpleNamespace(pytorch=pytorch, Linear=Linear, autocast=autocast, calls=calls, state=state)


# -- writing the copies from the wheel -------------------------------------------------------------------------------
def _excerpt(source: str, cls: Optional[str], name: str, whole: bool) -> str:
    lines = source.splitlines()
    tree = ast.parse(source)
    scope = tree.body
    if cls is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    if whole:
        text = lines[node.lineno - 1:node.end_lineno]  # from the `def` line: decorators dropped
    else:
        indent = " " * (node.col_offset + 4)  # the signature: up to the first statement of the body (or docstring)
        text = lines[node.lineno - 1:node.body[0].lineno - 1] + [f"{indent}..."]
    if cls is not None:
        text = [f"class {cls}:"] + text
    return "\n".join(text)


def _api_file(sources: Mapping[str, str]) -> str:
    header = sources[QUANTIZATION_SOURCE].splitlines()[:3]  # TE's copyright lines
    parts = ["\n".join(header) + "\n#\n"
             f"# Excerpts of Transformer Engine {TE_VERSION}'s\n"
             f"#   {QUANTIZATION_SOURCE}\n"
             f"#   {LINEAR_SOURCE}\n"
             "# (see NOTICE), written by tests/support/te_source.py: the signatures of the API that lightning_fp8's TE\n"
             "# backend calls (bodies elided as `...`) and the delayed-scaling scale update it plugs a function into\n"
             "# (verbatim, decorators dropped).\n"
             "from __future__ import annotations\n\nimport torch\n"]
    for path, cls, name, whole in API_EXCERPTS:
        parts.append(f"# {path}\n" + _excerpt(sources[path], cls, name, whole) + "\n")
    return "\n\n".join(parts)


def files_from_wheel(wheel: Path) -> Iterator[Tuple[str, bytes]]:
    """(file name under DATA_DIR, content) of every copy, made from the wheel."""
    with zipfile.ZipFile(wheel) as z:
        read = lambda name: z.read(name)  # noqa: E731
        record = read(RECORD_SOURCE).decode().splitlines()
        used = (RECIPE_SOURCE, QUANTIZATION_SOURCE, LINEAR_SOURCE, LICENSE_SOURCE)
        yield "recipe.py", read(RECIPE_SOURCE)
        yield "LICENSE", read(LICENSE_SOURCE)
        yield "RECORD", ("\n".join(line for line in record if line.split(",")[0] in used) + "\n").encode()
        sources = {p: read(p).decode() for p in (QUANTIZATION_SOURCE, LINEAR_SOURCE)}
        yield "pytorch_api.py", _api_file(sources).encode()


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path, help=f"transformer_engine-{TE_VERSION}-py3-none-any.whl")
    parser.add_argument("--check", action="store_true", help="compare with the files in the repository, write none")
    args = parser.parse_args(argv)
    differ = []
    for name, content in files_from_wheel(args.wheel):
        path = DATA_DIR / name
        if args.check:
            if not path.exists() or path.read_bytes() != content:
                differ.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
    if differ:
        print(f"differ from the wheel: {', '.join(differ)}")
        return 1
    print("written" if not args.check else "identical to the wheel's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
