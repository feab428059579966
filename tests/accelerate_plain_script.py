"""An Accelerate script not switched to FP8Accelerator: run by tests/test_accelerate_guard.py through
`python -m lightning_fp8.accelerate launch --mixed_precision fp8`."""
from accelerate import Accelerator

if __name__ == "__main__":
    accelerator = Accelerator(cpu=True)
    print("BUILT", accelerator.mixed_precision)
