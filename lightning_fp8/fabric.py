"""Public import path of the Fabric plugin: `from lightning_fp8.fabric import FP8Precision` (it lives in
lightning_fp8/integrations/fabric_plugin.py), and of `load_checkpoint`, which resumes sharded checkpoints with the plugin's
state."""
from lightning_fp8.integrations.fabric_plugin import FP8Precision, load_checkpoint

__all__ = ["FP8Precision", "load_checkpoint"]
