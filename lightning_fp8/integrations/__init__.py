"""Framework adapters (Lightning Trainer, Lightning Fabric, Hugging Face Accelerate): each a thin translation of the
framework's hooks into FP8TrainingEngine calls, sharing FP8PrecisionCore (plugin_core.py). No numerics live here."""
