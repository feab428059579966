"""Framework adapters: one module per framework, each a thin translation of the framework's hooks into
FP8TrainingEngine calls (lightning_fp8/engine). No numerics live here.

    lightning.py   FP8Precision for the Lightning Trainer      (public: lightning_fp8.FP8Precision)
    fabric.py      FP8Precision for Lightning Fabric          (public: lightning_fp8.fabric.FP8Precision)
    accelerate/    FP8Accelerator, FP8Kwargs for Accelerate    (public: lightning_fp8.accelerate)
    _options.py    the options all three take, validated once
    _core.py       what all three share: conversion, FP8 + autocast context, engine, checkpoint state
"""
