"""Optional third-party FP8 backends that run the same FP8Recipe with other modules (Transformer Engine).

Imported only where a user picks one (`FP8Precision(backend="transformer_engine")`: lightning_fp8/integrations/_core.py
imports it then); each backend raises a clear ImportError when its package is missing."""
