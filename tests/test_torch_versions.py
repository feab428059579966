"""The torch range: the core imports and trains on the oldest torch pyproject admits, and a recipe that needs a newer
torch refuses naming the release (numerics/formats.py TORCH_FEATURES). CI runs the pinned torch and the newest; these
tests keep the floor honest on either, by hiding what the floor's torch lacks."""
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_fp8.numerics.formats import TORCH_FEATURES, missing_torch_feature, torch_has
from lightning_fp8.recipe import SCALING_NEEDS_TORCH, FP8Recipe, TorchTooOldError

ROOT = Path(__file__).resolve().parents[1]


def _floor():
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'"torch>=(\d+)\.(\d+)"', text)
    assert match, "pyproject.toml names no torch floor"
    return int(match.group(1)), int(match.group(2))


def test_mxfp8_takes_e4m3_only():
    """torch's MX GEMM takes E4M3 operands only: format="hybrid" ran every gradient GEMM emulated (issue 35)."""
    with pytest.raises(ValueError, match=r"valid choices: format in \['e4m3'\]"):
        FP8Recipe(scaling="mxfp8", format="hybrid")
    with pytest.raises(ValueError, match="e4m3"):
        FP8Recipe(scaling="mxfp8", format="e5m2")
    if torch_has("float8_e8m0fnu"):
        assert FP8Recipe(scaling="mxfp8").format == "e4m3"
        assert FP8Recipe(scaling="mxfp8", format="e4m3").format_for("grad_output").name == "e4m3"


def test_feature_table_is_above_the_floor_and_read_off_torch():
    floor = _floor()
    for key, feature in TORCH_FEATURES.items():
        assert feature.since > floor, f"{key} is in torch {feature.since}, not above the floor {floor}: drop its guard"
        if torch_has(key):
            assert missing_torch_feature(key) is None
        else:
            assert f"torch {feature.since[0]}.{feature.since[1]} added" in missing_torch_feature(key)
    for scaling, key in SCALING_NEEDS_TORCH.items():
        assert key in TORCH_FEATURES, scaling
    assert torch_has("float8_e8m0fnu") == hasattr(torch, "float8_e8m0fnu")
    assert torch_has("float4_e2m1fn_x2") == hasattr(torch, "float4_e2m1fn_x2")
    with pytest.raises(ValueError, match="valid features"):
        torch_has("float6")


@pytest.mark.parametrize("scaling, dtype, release", [("mxfp8", "float8_e8m0fnu", "2.7"),
                                                       ("nvfp4", "float4_e2m1fn_x2", "2.8")])
def test_recipe_needing_a_newer_torch_refuses_naming_it(monkeypatch, scaling, dtype, release):
    if hasattr(torch, dtype):
        monkeypatch.delattr(torch, dtype)
    with pytest.raises(TorchTooOldError, match=rf"torch\.{dtype}, which torch {re.escape(release)} added.*"
                                               rf"install torch>={re.escape(release)}"):
        FP8Recipe(scaling=scaling)
    FP8Recipe(scaling="rowwise")  # what needs no newer dtype is unaffected
    FP8Recipe(scaling="blockwise")


#: a torch as old as the floor, on this one: the dtypes it lacks removed before lightning_fp8 is imported; then the
#: core (every package, a converted model's forward and backward in FP8 on the CPU, the Lightning plugin) must work,
#: and the recipes that need a newer torch must refuse by name
_FLOOR_PROBE = textwrap.dedent("""
    import torch, lightning, accelerate  # their own imports see the real torch
    for name in {hidden!r}:
        if hasattr(torch, name):
            delattr(torch, name)
    import lightning_fp8, lightning_fp8.fabric, lightning_fp8.accelerate, lightning_fp8.optim, lightning_fp8.callbacks
    import lightning_fp8.kernels
    from lightning_fp8 import FP8Recipe, convert_to_fp8
    from lightning_fp8.recipe import TorchTooOldError
    for scaling in ("delayed", "current", "rowwise", "blockwise"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
        convert_to_fp8(model, FP8Recipe(scaling=scaling))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(16, 32)).float().square().mean()
        loss.backward()
        assert torch.isfinite(loss), scaling
    for scaling in ("mxfp8", "nvfp4"):
        try:
            FP8Recipe(scaling=scaling)
        except TorchTooOldError as error:
            print(scaling, "refused:", error)
        else:
            raise AssertionError(scaling + " did not refuse")
    print("floor probe ok")
""")


def test_core_imports_and_trains_without_the_newer_dtypes():
    """What `import lightning_fp8` needs of torch is no more than the floor's torch has (before, torch 2.4 - 2.7
    failed the import on `torch.float4_e2m1fn_x2`)."""
    hidden = ["float8_e8m0fnu", "float4_e2m1fn_x2"]
    done = subprocess.run([sys.executable, "-c", _FLOOR_PROBE.format(hidden=hidden)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0 and "floor probe ok" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "mxfp8 refused: FP8Recipe(scaling='mxfp8')" in done.stdout and "torch 2.7 added" in done.stdout
    assert "nvfp4 refused: FP8Recipe(scaling='nvfp4')" in done.stdout and "torch 2.8 added" in done.stdout


#: the names torch 2.6's `infer_schema` evaluates a custom op's string annotations with (torch/_library/
#: infer_schema.py: `eval(annotation)` in its own module, not the op's): `typing.Tuple[...]` is not among them, so an
#: op written `-> Tuple[Tensor, ...]` under `from __future__ import annotations` fails `import lightning_fp8` there
_TORCH_26_SCHEMA_NAMES = ("typing", "List", "Optional", "Sequence", "Union", "device", "dtype", "Tensor", "types",
                          "torch")


def test_custom_op_annotations_parse_on_the_floor_torch():
    import typing

    import lightning_fp8.kernels.microscaled_ops  # noqa: F401  (registers its ops)
    import lightning_fp8.kernels.ops  # noqa: F401
    import lightning_fp8.kernels.tiled_ops  # noqa: F401
    import lightning_fp8.modules.gemm  # noqa: F401

    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:
        pytest.skip("torch._library.custom_ops.OPDEFS moved")
    from torch import Tensor, device, dtype, types  # noqa: F401

    namespace = {"typing": typing, "List": typing.List, "Optional": typing.Optional, "Sequence": typing.Sequence,
                 "Union": typing.Union, "device": device, "dtype": dtype, "Tensor": Tensor, "types": types,
                 "torch": torch}
    assert set(namespace) == set(_TORCH_26_SCHEMA_NAMES)
    ops = {name: op for name, op in OPDEFS.items() if name.startswith("lightning_fp8::")}
    assert ops, "no lightning_fp8 custom ops registered"
    bad = []
    for name, op in ops.items():
        fn = getattr(op, "_init_fn", None)
        if fn is None:
            pytest.skip("CustomOpDef._init_fn moved")
        signature = inspect.signature(fn)
        annotations = [p.annotation for p in signature.parameters.values()] + [signature.return_annotation]
        for annotation in annotations:
            if isinstance(annotation, str):
                try:
                    eval(annotation, dict(namespace))
                except Exception:
                    bad.append(f"{name}: {annotation!r}")
    assert not bad, ("custom-op annotations torch 2.6 cannot evaluate (write tuple[...] / list[...], not "
                     f"typing.Tuple[...]): {bad}")
