"""The `lightning-fp8 demo` command and the small models it trains (a char-GPT, its tensor-parallel layout, a variant
with a planted outlier channel)."""
