"""The core imports no framework (docs/architecture.md, "Import cost"): a plain PyTorch user of convert_to_fp8,
precision_map, the optimizers or the engine loads neither Lightning nor Accelerate nor transformers, and an Accelerate
run loads no Lightning. Each case runs in a fresh interpreter, since this one has imported everything already."""
import json
import subprocess
import sys
import textwrap

import pytest

#: top-level packages the framework-free parts must not import
FRAMEWORKS = ("lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities", "accelerate", "transformers",
              "torchmetrics")
LIGHTNING = ("lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities", "torchmetrics")


def _imported_after(code: str, watched) -> list:
    """The packages of `watched` that are in sys.modules after running `code` in a fresh interpreter."""
    probe = textwrap.dedent(code) + textwrap.dedent(f"""
        import json, sys
        print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & set({list(watched)!r}))))
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("statement", [
    "from lightning_fp8 import convert_to_fp8, FP8Linear, FP8Recipe",
    "from lightning_fp8 import precision_map",
    "import lightning_fp8.optim",
    "import lightning_fp8.engine",
    "from lightning_fp8.integrations.plugin_core import FP8PrecisionCore",
])
def test_the_core_imports_no_framework(statement):
    assert _imported_after(statement, FRAMEWORKS) == []


def test_converting_and_training_a_model_imports_no_framework():
    code = """
        import torch
        from lightning_fp8 import convert_to_fp8, precision_map
        model = convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                                   torch.nn.Linear(32, 32)), verbose=False)
        precision_map(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(4, 32)).float().sum().backward()
    """
    assert _imported_after(code, FRAMEWORKS) == []


def test_an_accelerate_run_imports_no_lightning():
    code = """
        import torch
        from lightning_fp8.accelerate import FP8Accelerator, FP8Kwargs
        accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[FP8Kwargs(snapshot_every=1)])
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                    torch.nn.Linear(32, 32))
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        for _ in range(2):
            loss = model(torch.randn(4, 32)).float().pow(2).mean()
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        assert accelerator.fp8_engine.step_count == 2, accelerator.fp8_engine.step_count
    """
    assert _imported_after(code, LIGHTNING) == []


def test_the_adapters_still_come_from_the_top_level():
    """The Lightning names of the top level load on first access (module __getattr__) and stay listed."""
    code = """
        import lightning_fp8
        assert "FP8Precision" in dir(lightning_fp8) and "FP8ScaleMonitor" in dir(lightning_fp8)
        import sys
        assert "lightning" not in sys.modules
        from lightning_fp8 import FP8Precision, FP8ScaleMonitor, FP8LayerFallback, FP8Calibration
        from lightning.pytorch.plugins.precision import Precision
        assert issubclass(FP8Precision, Precision)
        assert all(hasattr(lightning_fp8, name) for name in lightning_fp8.__all__)
    """
    assert "lightning" in _imported_after(code, LIGHTNING)
