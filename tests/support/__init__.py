"""Modules the tests and the workers import (none of them is a test): small models and data (helpers), small
Hugging Face models (hf_models), what the tensor-parallel workers share (parallel_training), how a multi-process
script ends (process_group) and how a test launches a worker (torchrun_launch).

Imported as `support.<module>`: pytest puts tests/ on sys.path (rootdir-relative "prepend" import of the test
modules, which are not a package), and each script in tests/workers/ puts tests/ there itself, once, at its top."""
