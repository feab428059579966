"""Run by tests/test_accelerate.py through a launcher: reports what FP8Accelerator() resolved, as JSON on stdout."""
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `support`
from support.helpers import mlp  # noqa: E402

from lightning_fp8 import FP8Linear  # noqa: E402
from lightning_fp8.accelerate import FP8Accelerator  # noqa: E402

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    accelerator = FP8Accelerator()
    model = accelerator.prepare(mlp())
    out = model(torch.randn(4, 32))
    report = {
        "mixed_precision": accelerator.mixed_precision,
        "env": os.environ.get("ACCELERATE_MIXED_PRECISION"),
        "fp8_layers": sum(isinstance(m, FP8Linear) and m.fp8_enabled for m in model.modules()),
        "engine": accelerator.fp8_engine is not None,
        "out_dtype": str(out.dtype),
    }
    print("PROBE " + json.dumps(report))
    accelerator.end_training()  # how an Accelerate script ends (it ends the process group where there is one)
