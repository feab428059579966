"""litgpt in FP8 without editing litgpt: `python -m lightning_fp8.litgpt COMMAND ... --precision fp8 [--fp8.OPTION
VALUE ...]` runs litgpt's own CLI (`litgpt COMMAND ...`) with every Fabric it builds carrying
`lightning_fp8.fabric.FP8Precision` (it lives in lightning_fp8/integrations/litgpt_fabrics.py). `fp8_fabrics(make_plugin)`
is the same for code that calls litgpt's functions directly."""
from lightning_fp8.integrations.litgpt_fabrics import fp8_fabrics, main

__all__ = ["main", "fp8_fabrics"]

if __name__ == "__main__":
    main()
