"""The CUDA contract suite: the GPU code path, proven on CPU (docs/status.md lists what it covers and what only a GPU
can show).

Every user trains on a GPU; the machines this runs on have none. `kernels.device.simulate_cuda(capability)` makes
CPU and meta tensors take the paths CUDA takes (the torch reference casts, or the Triton kernels under the Triton
interpreter; the scaled-GEMM planning for that architecture), and this file checks those paths with what a CPU can run:

- ops: `torch.library.opcheck` of every custom op on every implementation path (CPU twin, torch reference, Triton
  under the interpreter): the fake implementations (what torch.compile plans with) describe the real outputs;
- GEMM contract: every scaled-GEMM call a full FP8Linear forward + backward makes, for every recipe, output dtype,
  shape that matters and architecture, replayed on meta tensors against torch's own checks and against the rules
  of lightning_fp8/modules/scaled_mm.py for what meta cannot see;
- GEMM numerics: the same argument preparation run through torch 2.13's CPU `_scaled_mm` equals the emulation;
- compile: inductor with the implementations CUDA uses;
- host syncs: none inside FP8Linear's forward / backward on the CUDA path.

Tests whose names contain "interp_" need the Triton interpreter from the start of the process;
`test_interpreter_part` runs them in a fresh process with TRITON_INTERPRET=1.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from lightning_fp8.kernels.device import simulate_cuda

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET", "") == "1"
interp = pytest.mark.skipif(not INTERPRETING or not HAS_TRITON or torch.cuda.is_available(),
                            reason="runs inside test_interpreter_part (TRITON_INTERPRET=1 from the process start)")

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.skipif(not HAS_TRITON or INTERPRETING or torch.cuda.is_available(),
                    reason="needs triton and no GPU; runs the interp_ tests of this file")
def test_interpreter_part():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "interp_"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1]


# -- ops: opcheck on every implementation path --------------------------------------------------------------------
#: the paths an op can take on CPU: the CPU twins, the torch reference CUDA runs without triton, and (interpreter
#: only) the Triton kernels CUDA runs
PATHS = {"cpu_twin": None, "cuda_reference": dict(capability=(9, 0), triton=False)}


def _path(name):
    simulation = PATHS[name] if name in PATHS else dict(capability=(9, 0), triton=True)
    return simulate_cuda(**simulation) if simulation is not None else _nothing()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _inputs(shape, layout, seed=0):
    """A float32 tensor of `shape` in a row-major or a transposed (column-major) layout, with values across FP8's
    range (a few elements saturate E4M3 at scale 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape if layout == "row" else shape[::-1], generator=g) * torch.exp2(
        torch.randint(-8, 10, shape if layout == "row" else shape[::-1], generator=g).float())
    return x if layout == "row" else x.t()


def _cast_cases():
    history = lambda: torch.zeros(3, 5)  # noqa: E731
    warm = lambda: torch.tensor([[0.0, 3.0, 1.0, 0, 0]] * 3)  # noqa: E731  (a history that sizes delayed scales)
    for layout in ("row", "t"):
        x = _inputs((48, 80), layout)
        yield f"fp8_cast-{layout}", torch.ops.lightning_fp8.fp8_cast.default, (
            x, torch.tensor(2.0), "e4m3", None, None, None, True, True, True)
        yield f"fp8_cast-amax-{layout}", torch.ops.lightning_fp8.fp8_cast.default, (
            x, torch.tensor(0.5), "e5m2", None, None, None, False, False, True)
        for scaling, hist in (("delayed", warm), ("delayed", history), ("current", history), ("none", history)):
            for write_t in (False, True):
                yield (f"scaled_cast-{scaling}-{'warm' if hist is warm else 'cold'}-t{int(write_t)}-{layout}",
                       torch.ops.lightning_fp8.scaled_cast.default,
                       (x, hist(), 1, "e4m3", scaling, True, 0, True, None, None, write_t, True))
        for tiles in (((1, 0), (1, 0)), ((1, 128), (1, 128)), ((128, 128), (128, 128)), ((1, 32), ())):
            yield (f"tiled_cast-{tiles}-{layout}", torch.ops.lightning_fp8.tiled_cast.default,
                   (x, history(), 0, "e4m3", list(tiles[0]), list(tiles[1]), 0, True, None, True))
    yield "close_scaling_step", torch.ops.lightning_fp8.close_scaling_step.default, (
        torch.tensor([[5.0, 3.0, 1.0, 0, 0]] * 3), torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
        torch.tensor([448.0, 448.0, 57344.0]), torch.tensor([True] * 3), torch.tensor([True] * 3),
        torch.tensor([True] * 3), torch.zeros(3), torch.tensor([True] * 3), True)


CAST_CASES = {name: (op, args) for name, op, args in _cast_cases()}
#: opcheck's tests that apply to ops that take and return float8 tensors ("test_schema" runs arithmetic on the
#: inputs, which CPU float8 tensors do not implement); the cast ops take no float8 input, so they get all four
CAST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck(op, args, utils):
    clone = lambda a: a.clone() if isinstance(a, torch.Tensor) else a  # noqa: E731  (ops mutate the histories)
    torch.library.opcheck(op, tuple(clone(a) for a in args), test_utils=utils)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(CAST_CASES))
def test_cast_ops_match_their_fake_impls(case, path):
    """The fake implementation of each cast op (shapes, dtypes, strides: what torch.compile plans with) equals what
    the op returns on this path. The CUDA reference path returned a column-major x^T from tiled_cast while the fake
    promised a contiguous one: inductor failed a stride assertion on every rowwise / blockwise layer."""
    op, args = CAST_CASES[case]
    with _path(path):
        _opcheck(op, args, CAST_UTILS)


@interp
@pytest.mark.parametrize("case", [c for c in CAST_CASES if not c.startswith("tiled_cast")])
def test_interp_cast_ops_match_their_fake_impls_on_the_triton_path(case):
    op, args = CAST_CASES[case]
    from lightning_fp8 import kernels

    with _path("triton"):
        assert kernels.triton_enabled_for(args[0]), "the Triton path must be the one under test"
        _opcheck(op, args, CAST_UTILS)
