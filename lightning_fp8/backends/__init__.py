"""Optional third-party FP8 backends that run the same FP8Recipe with other modules (Transformer Engine), imported
only where a user picks one (`FP8Precision(backend="transformer_engine")`); each raises an ImportError saying what to
install when its package is missing."""
