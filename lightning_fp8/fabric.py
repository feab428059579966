"""Public import path of the Fabric plugin: `from lightning_fp8.fabric import FP8Precision` (it lives in
lightning_fp8/integrations/fabric.py)."""
from lightning_fp8.integrations.fabric import FP8Precision

__all__ = ["FP8Precision"]
