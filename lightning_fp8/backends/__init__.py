"""Optional third-party FP8 backends that run the same FP8Recipe with other modules (Transformer Engine).

Nothing here is imported by the rest of the library; each backend raises a clear ImportError when its package is
missing."""
